"""Async streaming client: send a trace to an OpenAI-compatible server on schedule and
record, per request, when every piece of generated text arrived.

Each request is sent at its ``offset_s`` after a common start (``time.perf_counter``),
as ``POST /v1/chat/completions`` (a single user message: the prompt, then one OpenAI
``image_url`` content part per image of the request, a data URL of the seeded picture
of :mod:`epdserve.bench.images`) or ``POST /v1/completions``, with ``stream: true``,
``stream_options.include_usage`` and vLLM's ``ignore_eos`` (so output lengths are as
asked). Server-sent events are read line by line; the times kept
are the ones the metrics of :mod:`epdserve.bench.metrics` need (see :class:`RequestRecord`):

* ``t0`` — just before the request is sent;
* the arrival of every chunk that carries generated text (a non-empty
  ``choices[0].delta.content``, or ``choices[0].text`` for completions);
* the arrival of the last data chunk before ``[DONE]`` (text, finish or usage chunk — as
  vLLM ``bench serve`` takes its latency).

Request bodies, pictures included, are built and JSON-encoded before the run starts, so
making them never delays a send or counts in its TTFT.

A request fails — and the message is kept — on a connection error or timeout, an HTTP
status other than 200, an ``error`` event in the stream, a stream that ends without
``[DONE]``, or a stream without any generated text (its TTFT would be undefined).
"""

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
    """The server did not answer at all; the message names the URL."""


class WarmupFailed(ClientError):
    """The unmeasured warm-up request failed (wrong model name, endpoint, server error)."""


class UnsupportedWorkload(ClientError):
    """The trace asks for something this client cannot send (images to /v1/completions)."""


def check_sendable(requests: list[Request], endpoint: str = "chat") -> None:
    """Refuse images on the completions endpoint: a text prompt has no place for them
    (OpenAI takes images only as chat content parts), and sending the text alone would
    measure another workload than the one asked for.

    Raises:
        UnsupportedWorkload: ``endpoint`` is "completions" and some request carries images.
    """
    with_images = sum(1 for r in requests if r.images)
    if with_images and endpoint != "chat":
        raise UnsupportedWorkload(
            f"{with_images} of {len(requests)} requests carry images, which only the chat "
            f"endpoint takes; use --endpoint chat, or --images-per-request 0 or a trace "
            f"without images")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds (``time.perf_counter``).

    ``index``: position in the trace; ``start_s``: t0 relative to the run's start;
    ``chunk_times_s``: arrival of each text-carrying chunk, relative to t0;
    ``last_chunk_s``: arrival of the last data chunk, relative to t0 (None if none came);
    ``end_s``: when the request finished (success or failure), relative to the run's start;
    ``usage_prompt_tokens`` / ``usage_completion_tokens``: the server's usage (None if not
    sent); ``expected_prompt_tokens``: the trace's ``prompt_tokens``;
    ``request_id``: the response ``id`` (the server-side request id);
    ``generated_text``: the text that streamed back.
    """

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
        """First text-carrying chunk − t0 (s), or None without text."""
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text-carrying chunks (s)."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el_s(self) -> float | None:
        """Last chunk − t0 (s), or None if no chunk came."""
        return self.last_chunk_s

    @property
    def output_tokens(self) -> int:
        """usage.completion_tokens when the server sent it, else the text-chunk count."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times_s)

    @property
    def prompt_tokens(self) -> int:
        """usage.prompt_tokens (what the server processed, chat template included) when
        sent, else the trace's expected count."""
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.expected_prompt_tokens


def _url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + path


def make_client(num_requests: int = 100, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """One HTTP client for the whole run: a connection per in-flight request (no queueing
    in the client), ``timeout_s`` per read, and no proxy from the environment. With
    ``$OPENAI_API_KEY`` set, every request carries ``Authorization: Bearer`` that key, as
    ``vllm bench serve`` and the openai SDK send it (a server started with ``--api-key``)."""
    limits = httpx.Limits(max_connections=max(100, num_requests),
                          max_keepalive_connections=max(100, num_requests))
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    key = os.environ.get("OPENAI_API_KEY")
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                             headers={"Authorization": f"Bearer {key}"} if key else None)


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        ServerUnreachable: no answer, an HTTP error, or no models listed.
    """
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
    """The JSON body for ``req`` (``endpoint`` "chat" or "completions"). A chat request
    with images gets list content: a text part with the prompt, then one ``image_url``
    part per image (OpenAI's form), each a JPEG data URL (:func:`images.data_url`).

    Raises:
        UnsupportedWorkload: images with ``endpoint`` "completions".
    """
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
    """The message of an OpenAI-style error body ``{"error": {"message": ...}}``, or the
    body itself as JSON when it has another shape (e.g. FastAPI's ``{"detail": ...}``)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str) and err:
        return err
    return json.dumps(obj)


def encode_body(body: dict) -> bytes:
    """A request body as the JSON bytes :func:`send_one` posts."""
    return json.dumps(body).encode()


async def send_one(client: httpx.AsyncClient, url: str, body: bytes, record: RequestRecord,
                   run_start: float, endpoint: str = "chat") -> RequestRecord:
    """POST ``body`` (JSON bytes, :func:`encode_body`: encoded before t0, as a data URL
    of a large image takes a while to serialise) to ``url`` now and fill ``record`` from
    the stream (see module doc)."""
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
    """A failed request's error: its status and the server's message."""
    text = (await response.aread()).decode(errors="replace")
    try:
        text = _error_text(json.loads(text))
    except ValueError:
        pass
    return f"HTTP {response.status_code}: {text[:500]}"


async def _read_stream(response: httpx.Response, record: RequestRecord, t0: float, endpoint: str) -> bool | None:
    """Read the server-sent events into ``record``: True once ``[DONE]`` came, False when
    the stream ended before it, None on a chunk that is not a JSON object or an error event
    (``record.error`` says which)."""
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
    """One data chunk, ``elapsed_s`` after t0: the last chunk's time, the response id, the
    generated text and its time (when it carries text), and the usage."""
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


LAG_INTERVAL_S = 0.1  # how often LoopLag wakes: fine enough for stalls that matter to a TTFT
STALL_S = 0.5  # a wake-up at least this late is a stall (half a second of every TTFT then)


class LoopLag:
    """How late this client's event loop runs during a trace: a task wakes every
    ``interval_s`` and records how far past its deadline it woke (s). Every send and every
    chunk's arrival stamp is taken by this loop, so a loop that is blocked (a synchronous
    call, another thread holding the GIL) or not given a CPU delays them by as much: the
    client's TTFT and ITL then include the client's own delay, not the server's.

    Use: :meth:`start` from inside the running loop (e.g. :func:`run_trace`'s ``on_start``);
    the task ends with the loop (``asyncio.run`` cancels it) or at :meth:`stop`; then
    :meth:`summary`."""

    def __init__(self, interval_s: float = LAG_INTERVAL_S, stall_s: float = STALL_S):
        if interval_s <= 0:
            raise ValueError(f"interval_s {interval_s}: must be > 0")
        self.interval_s, self.stall_s = interval_s, stall_s
        self.samples: list[tuple[float, float]] = []  # (deadline after start s, lateness s)
        self._task: asyncio.Task | None = None

    def start(self) -> LoopLag:
        """Start sampling on the running loop (call from a coroutine or a callback it runs).

        Raises:
            RuntimeError: no event loop is running in this thread.
        """
        self.origin = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def stop(self) -> None:
        """Stop sampling (a no-op once the loop has ended)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.samples.append((due - self.origin, time.perf_counter() - due))

    def summary(self) -> dict:
        """``{"interval_ms", "samples", "max_ms", "p99_ms", "stalled_s" (the lateness summed
        over stalls), "stalls": [[at_s, late_s], ...]}`` — each stall is a wake-up at least
        ``stall_s`` late: when it was due (s after :meth:`start`) and how late it came;
        ``max_ms``/``p99_ms`` None without samples."""
        lates = sorted(late for _, late in self.samples)
        stalls = [[round(at, 3), round(late, 3)] for at, late in self.samples if late >= self.stall_s]
        pct = lambda q: round(lates[min(len(lates) - 1, int(q * len(lates)))] * 1e3, 1) if lates else None  # noqa: E731
        return {"interval_ms": self.interval_s * 1e3, "samples": len(lates), "max_ms": pct(1.0),
                "p99_ms": pct(0.99), "stalled_s": round(sum(late for _, late in stalls), 3), "stalls": stalls}


WARMUP_PROMPT = "Say hello."
WARMUP_MAX_TOKENS = 4
# Seeds of warm-up pictures: above any image number of a trace, so the warm-up never puts
# a picture the trace sends into the server's embedding cache.
WARMUP_IMAGE_SEED = 2**40


def warmup_request(i: int, images: tuple[dict, ...] = ()) -> Request:
    """Warm-up request ``i``: a short prompt with pictures of the sizes of ``images``
    (seeds from :data:`WARMUP_IMAGE_SEED`, new for every ``i``)."""
    pictures = tuple({"width": x["width"], "height": x["height"],
                      "seed": WARMUP_IMAGE_SEED + i * len(images) + k}
                     for k, x in enumerate(images))
    return Request(offset_s=0.0, prompt=WARMUP_PROMPT, max_tokens=WARMUP_MAX_TOKENS,
                   kind="chat", prompt_tokens=0, images=pictures)


async def warm_up(client: httpx.AsyncClient, url: str, model: str, num: int,
                  endpoint: str = "chat", images: tuple[dict, ...] = ()) -> None:
    """Send ``num`` short requests one after another, unmeasured (first-call costs such as
    lazy initialisation stay out of the results; a wrong model name or endpoint shows up
    before the run instead of as N failures). With ``images`` (a trace request's), each
    carries new pictures of those sizes, so the vision encoder's first call is not
    measured either, and a server without vision support fails here.

    Raises:
        WarmupFailed: a warm-up request failed; the message is the server's.
    """
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
    """Send ``warmup`` unmeasured requests, then every request of the trace at its offset
    after a common start; return the records in trace order.

    ``on_start``: called (blocking) after the warm-up, right before the first request is
    due, e.g. to take the server's metrics before the measured requests only.

    ``max_concurrency``: at most this many requests in flight; a request due while all
    slots are busy waits for one and is sent (t0) when it gets it — vLLM ``bench
    serve``'s semantics, so with every offset 0 this is a closed loop of C clients.

    Raises:
        UnsupportedWorkload: the trace carries images and ``endpoint`` is "completions".
        ServerUnreachable: the server does not answer ``GET /v1/models`` before the run.
        WarmupFailed: a warm-up request failed.
    """
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
