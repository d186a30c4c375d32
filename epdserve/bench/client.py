"""Async streaming client: sends a trace on schedule and records when each text chunk arrived
(request format and failure cases: docs/comparing.md, "epdserve bench")."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from epdserve.bench import images as synthetic_images
from epdserve.bench.workload import Request


class ClientError(RuntimeError):
    """The run could not start; the message says why in one line."""


class ServerUnreachable(ClientError):
    """The server did not answer; the message names the URL."""


class WarmupFailed(ClientError):
    """The unmeasured warm-up request failed (wrong model name, endpoint, server error)."""


class UnsupportedWorkload(ClientError):
    """The trace asks for images on /v1/completions."""


def check_sendable(requests: list[Request], endpoint: str = "chat") -> None:
    """Raises UnsupportedWorkload for images on the completions endpoint: sending the text
    alone would measure another workload."""
    with_images = sum(1 for r in requests if r.images)
    if with_images and endpoint != "chat":
        raise UnsupportedWorkload(
            f"{with_images} of {len(requests)} requests carry images, which only the chat "
            f"endpoint takes; use --endpoint chat, or --images-per-request 0 or a trace "
            f"without images")


@dataclass
class RequestRecord:
    """What the client saw of one request, in seconds: ``start_s`` and ``end_s`` after the
    run's start, ``chunk_times_s`` (text-carrying chunks) and ``last_chunk_s`` after t0 (the send)."""

    index: int
    kind: str = "chat"
    offset_s: float = 0.0
    max_tokens: int = 0
    expected_prompt_tokens: int = 0
    start_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    last_chunk_s: float | None = None
    end_s: float = 0.0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    request_id: str | None = None
    generated_text: str = ""
    success: bool = False
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el_s(self) -> float | None:
        return self.last_chunk_s

    @property
    def output_tokens(self) -> int:
        """usage.completion_tokens when sent, else the text-chunk count."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times_s)

    @property
    def prompt_tokens(self) -> int:
        """usage.prompt_tokens (chat template included) when sent, else the trace's count."""
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.expected_prompt_tokens


def _url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


def make_client(num_requests: int = 100, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """One connection per in-flight request, ``timeout_s`` per read, no proxy from the
    environment; ``$OPENAI_API_KEY`` is sent as a Bearer token, as vLLM and the openai SDK do."""
    limits = httpx.Limits(max_connections=max(100, num_requests),
                          max_keepalive_connections=max(100, num_requests))
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    key = os.environ.get("OPENAI_API_KEY")
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                             headers={"Authorization": f"Bearer {key}"} if key else None)


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of ``GET /v1/models``; raises ServerUnreachable."""
    url = _url(base_url, "/v1/models")
    try:
        response = await client.get(url, timeout=10.0)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ServerUnreachable(f"cannot reach server at {url}: "
                                f"{type(exc).__name__} {exc}".rstrip()) from None
    if response.status_code != 200:
        raise ServerUnreachable(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnreachable(f"{url}: no model id in {response.text[:200]!r}") from None


def request_body(req: Request, model: str, endpoint: str = "chat", temperature: float = 0.0,
                 ignore_eos: bool = True) -> dict:
    """Raises UnsupportedWorkload for images with ``endpoint`` "completions"."""
    body = {"model": model, "max_tokens": req.max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    if endpoint == "chat":
        content = req.prompt
        if req.images:
            content = [{"type": "text", "text": req.prompt}] + [
                {"type": "image_url", "image_url": {"url": synthetic_images.data_url(x)}}
                for x in req.images]
        body["messages"] = [{"role": "user", "content": content}]
    else:
        check_sendable([req], endpoint)
        body["prompt"] = req.prompt
    return body


def _error_text(obj) -> str:
    """An OpenAI error body's message, else the body as JSON (e.g. FastAPI's ``detail``)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    return json.dumps(obj)


def encode_body(body: dict) -> bytes:
    return json.dumps(body).encode()


async def send_one(client: httpx.AsyncClient, url: str, body: bytes, record: RequestRecord,
                   run_start: float, endpoint: str = "chat") -> RequestRecord:
    """POST ``body``, encoded before t0 (a large image's data URL takes a while), and fill
    ``record`` from the stream."""
    t0 = time.perf_counter()
    record.start_s = t0 - run_start
    try:
        async with client.stream("POST", url, content=body,
                                 headers={"content-type": "application/json"}) as response:
            if response.status_code != 200:
                record.error = await _http_error(response)
                return record
            done = await _read_stream(response, record, t0, endpoint)
            if done is None:  # a bad chunk or an error event: record.error says which
                return record
        if not done:
            record.error = "stream ended before [DONE]"
        elif not record.chunk_times_s:
            record.error = "stream carried no generated text"
        else:
            record.success = True
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    finally:
        record.end_s = time.perf_counter() - run_start
    return record


async def _http_error(response: httpx.Response) -> str:
    text = (await response.aread()).decode(errors="replace")
    try:
        text = _error_text(json.loads(text))
    except ValueError:
        pass
    return f"HTTP {response.status_code}: {text[:500]}"


async def _read_stream(response: httpx.Response, record: RequestRecord, t0: float, endpoint: str) -> bool | None:
    """True after ``[DONE]``, False when the stream ends before it, None on a bad chunk or
    an error event (``record.error`` says which)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        now = time.perf_counter()
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            record.error = f"bad stream chunk: {data[:200]!r}"
            return None
        if "error" in obj and obj["error"]:
            record.error = f"error event: {_error_text(obj)[:500]}"
            return None
        _take_chunk(record, obj, now - t0, endpoint)
    return False


def _take_chunk(record: RequestRecord, obj: dict, elapsed_s: float, endpoint: str) -> None:
    record.last_chunk_s = elapsed_s
    if obj.get("id") and record.request_id is None:
        record.request_id = str(obj["id"])
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0] or {}
        text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
        if text:
            record.chunk_times_s.append(elapsed_s)
            record.generated_text += text
    usage = obj.get("usage")
    if usage:
        record.usage_prompt_tokens = usage.get("prompt_tokens")
        record.usage_completion_tokens = usage.get("completion_tokens")


LAG_INTERVAL_S = 0.1
STALL_S = 0.5  # a wake-up this late is a stall


class LoopLag:
    """How late this client's event loop wakes (s) every ``interval_s``: sends and chunk
    stamps are taken on it, so a blocked or starved loop adds its delay to TTFT and ITL.
    :meth:`start` from inside the running loop."""

    def __init__(self, interval_s: float = LAG_INTERVAL_S, stall_s: float = STALL_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s {interval_s}: must be > 0")
        self.interval_s, self.stall_s = interval_s, stall_s
        self.samples: list[tuple[float, float]] = []  # (deadline after start s, lateness s)
        self._task: asyncio.Task | None = None

    def start(self) -> LoopLag:
        """Raises RuntimeError when no event loop runs in this thread."""
        self.origin = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.samples.append((due - self.origin, time.perf_counter() - due))

    def summary(self) -> dict:
        """``interval_ms``, ``samples``, ``max_ms``/``p99_ms`` (None without samples),
        ``stalled_s`` and ``stalls``: ``[due s after start, late s]`` of each wake-up ``stall_s`` late."""
        lates = sorted(late for _, late in self.samples)
        stalls = [[round(at, 3), round(late, 3)] for at, late in self.samples if late >= self.stall_s]
        pct = lambda q: round(lates[min(len(lates) - 1, int(q * len(lates)))] * 1e3, 1) if lates else None  # noqa: E731
        return {"interval_ms": self.interval_s * 1e3, "samples": len(lates), "max_ms": pct(1.0),
                "p99_ms": pct(0.99), "stalled_s": round(sum(late for _, late in stalls), 3), "stalls": stalls}


WARMUP_PROMPT = "Say hello."
WARMUP_MAX_TOKENS = 4
# Above any trace's image number: the warm-up never caches a picture the trace sends.
WARMUP_IMAGE_SEED = 2**40


def warmup_request(i: int, images: tuple[dict, ...] = ()) -> Request:
    pictures = tuple({"width": x["width"], "height": x["height"],
                      "seed": WARMUP_IMAGE_SEED + i * len(images) + k}
                     for k, x in enumerate(images))
    return Request(offset_s=0.0, prompt=WARMUP_PROMPT, max_tokens=WARMUP_MAX_TOKENS,
                   kind="chat", prompt_tokens=0, images=pictures)


async def warm_up(client: httpx.AsyncClient, url: str, model: str, num: int,
                  endpoint: str = "chat", images: tuple[dict, ...] = ()) -> None:
    """``num`` unmeasured requests in turn, with new pictures of ``images``' sizes.
    Raises WarmupFailed with the server's message."""
    for i in range(num):
        body = encode_body(request_body(warmup_request(i, images), model, endpoint))
        record = await send_one(client, url, body, RequestRecord(-1), time.perf_counter(),
                                endpoint)
        if not record.success:
            raise WarmupFailed(f"warm-up request to {url} failed: {record.error}")


async def run_trace(base_url: str, model: str, requests: list[Request], endpoint: str = "chat",
                    temperature: float = 0.0, ignore_eos: bool = True, progress: bool = True,
                    timeout_s: float = 600.0, warmup: int = 1,
                    max_concurrency: int | None = None,
                    on_start: Callable[[], None] | None = None) -> list[RequestRecord]:
    """Warm up, then send every request at its offset after a common start; records in
    trace order. ``on_start`` runs (blocking) right before the first is due; ``max_concurrency``
    follows vLLM ``bench serve`` (a due request waits for a slot; t0 is when it gets one).

    Raises UnsupportedWorkload, ServerUnreachable (before the run), WarmupFailed."""
    check_sendable(requests, endpoint)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency {max_concurrency}: must be >= 1")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = _url(base_url, path)
    bodies = [encode_body(request_body(r, model, endpoint, temperature, ignore_eos))
              for r in requests]
    async with make_client(len(requests), timeout_s) as client:
        await fetch_model_name(client, base_url)  # fail fast, one line, if nobody answers
        await warm_up(client, url, model, warmup, endpoint,
                      next((r.images for r in requests if r.images), ()))
        if on_start is not None:
            on_start()
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        run_start = time.perf_counter()

        async def scheduled(i: int, req: Request) -> RequestRecord:
            delay = run_start + req.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(index=i, kind=req.kind, offset_s=req.offset_s,
                                   max_tokens=req.max_tokens,
                                   expected_prompt_tokens=req.prompt_tokens)
            if slots is None:
                await send_one(client, url, bodies[i], record, run_start, endpoint)
            else:
                async with slots:
                    await send_one(client, url, bodies[i], record, run_start, endpoint)
            bar.update(1)
            return record

        try:
            return list(await asyncio.gather(*(scheduled(i, r) for i, r in enumerate(requests))))
        finally:
            bar.close()
