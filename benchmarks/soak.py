"""Soak: a 2P2D deployment under moderate load for ``--minutes``, with random client
aborts and one ``kill -9`` of each role, then checks that nothing failed or leaked.

Load: streamed completions arriving as a Poisson process at ``--rate`` requests/s
(prompts of 30-400 tokens, 8-64 output tokens, greedy, ``ignore_eos``); a share
``--abort-share`` of them is left by the client after 0-8 events. At 35% of the run
``prefill-0`` is killed with SIGKILL, at 65% ``decode-1``; the launcher restarts each.

Goals:

* **0 failed requests** other than those on a killed worker: a request that ends with an
  error event or a non-200 status fails; one whose error names the killed worker (the
  router's message says "worker decode-1 died ...") is counted apart. Requests on a
  prefill worker killed before their first token are retried elsewhere and must succeed.
* **RSS growth < 5 %** after warm-up (the first 20 % of the run) for the router (its
  own process under serve) and every worker that was not killed: median of the last 10 % of the
  samples over the median of the samples at the end of warm-up.
* **no leak of private memory**: USS (private pages) growth < 2 % over the second half of
  the run (the median of the last 10 % over the median of the 15 s before the half). USS
  after warm-up is reported too, but not judged: a prefill worker's private memory is
  small (~230 MiB; its KV pool is shared with the decode workers that map it), and its
  allocator's high-water mark steps up by tens of MiB the first time it prefills a larger
  batch (as when the other prefill worker is killed and it takes all the prompts), then
  stays flat. A leak keeps growing through the second half; a high-water mark does not.
* **0 leaked blocks or frames**: at the end, no request in flight, every worker's KV
  blocks in use 0, and no staged KV frame (``/dev/shm/epdserve-kv-<pid>-...``) of a
  live worker left.

Writes ``soak.json`` (every request's outcome, the memory samples, the verdicts) and
``soak.png`` (USS and RSS of each process over time, kills marked) to ``--output``, and exits 1
if a goal is missed::

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--rate 0.3] [--abort-share 0.2] [--output results/soak]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from epdserve.bench.processes import ServerProcess, port_is_free  # noqa: E402
from epdserve.host import child_pids  # noqa: E402

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
KILLS = ((0.35, "prefill-0"), (0.65, "decode-1"))
WARMUP_SHARE, TAIL_SHARE = 0.2, 0.1
WORDS = ("the harbour master counted ships and wrote their names in a ledger by the light of a "
         "lamp while the tide came in over the stones of the old quay").split()


def memory_mb(pid: int) -> tuple[float, float] | None:
    """``(RSS, USS)`` of ``pid`` in MiB, or None once it is gone. USS (private pages) is
    what a leak grows: RSS also counts shared pages, and a decode worker maps each prefill
    worker's whole KV pool (1 GiB by default) at its first hand-off from it."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    kb = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", text, re.M)}
    return kb["Rss"] / 1024, (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, t0: float) -> dict:
    """Send one streamed completion; returns its record: ``outcome`` "ok", "left" (the
    client aborted it on purpose) or "failed", with ``error`` and times (s from ``t0``)."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 400)))
    body = {"prompt": prompt, "max_tokens": rng.randint(8, 64), "temperature": 0, "ignore_eos": True,
            "stream": True}
    leave_after = rng.randint(0, 8) if rng.random() < ARGS.abort_share else None
    rec = {"start_s": time.monotonic() - t0, "outcome": "ok", "error": None, "events": 0}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                rec.update(outcome="failed", error=f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.update(outcome="failed", error=data["error"]["message"])
                    break
                rec["events"] += 1
                if leave_after is not None and rec["events"] >= leave_after:
                    rec["outcome"] = "left"
                    break
    except httpx.HTTPError as exc:
        rec.update(outcome="failed", error=f"{type(exc).__name__}: {exc}")
    rec["end_s"] = time.monotonic() - t0
    return rec


async def load(url: str, duration_s: float, launcher_pid: int, t0: float) -> tuple[list[dict], list[dict], list]:
    """Run the load, the kills and the RSS sampling for ``duration_s``; returns the request
    records, the memory samples (``{"t_s", "process", "rss_mb", "uss_mb"}``) and the kills ``(t_s, id)``."""
    rng = random.Random(ARGS.seed)
    records, samples, kills, tasks = [], [], [], []
    pending_kills = list(KILLS)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
        next_arrival = next_sample = next_report = 0.0
        while (now := time.monotonic() - t0) < duration_s:
            if now >= next_arrival:
                tasks.append(asyncio.create_task(one_request(client, url, rng, t0)))
                next_arrival = now + rng.expovariate(ARGS.rate)
            if now >= next_sample:
                pids = {"serve": launcher_pid, **child_pids(launcher_pid)}
                samples += [{"t_s": now, "process": name, "rss_mb": mb[0], "uss_mb": mb[1]}
                            for name, pid in pids.items() if (mb := memory_mb(pid)) is not None]
                next_sample = now + 5.0
            if pending_kills and now >= pending_kills[0][0] * duration_s:
                _, victim = pending_kills.pop(0)
                os.kill(child_pids(launcher_pid)[victim], signal.SIGKILL)
                kills.append((now, victim))
                print(f"[{now:6.1f} s] kill -9 {victim}", flush=True)
            if now >= next_report:
                done = sum(t.done() for t in tasks)
                print(f"[{now:6.1f} s] {len(tasks)} requests sent, {done} done", flush=True)
                next_report = now + 30.0
            await asyncio.sleep(0.05)
        records = await asyncio.gather(*tasks)
    return list(records), samples, kills


def growth(samples: list[dict], process: str, duration_s: float, key: str = "uss_mb",
           since_share: float = WARMUP_SHARE) -> float | None:
    """Growth of ``process``'s ``key`` (``uss_mb`` or ``rss_mb``) from the 15 s before
    ``since_share`` of the run to its last 10 % (medians; see the module doc), or None
    without samples."""
    warm = [s[key] for s in samples if s["process"] == process
            and since_share * duration_s - 15 <= s["t_s"] <= since_share * duration_s]
    tail = [s[key] for s in samples if s["process"] == process and s["t_s"] >= (1 - TAIL_SHARE) * duration_s]
    if not warm or not tail:
        return None
    return statistics.median(tail) / statistics.median(warm) - 1


def leaks(url: str, launcher_pid: int, timeout_s: float = 60.0) -> dict:
    """What is still held once the load is over: requests in flight, outstanding requests
    and KV blocks in use per worker, staged KV frames of live workers in /dev/shm."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/health", timeout=10).json()
        held = {"requests_in_flight": health["requests_in_flight"],
                "blocks_in_use": {w["worker_id"]: w["blocks_in_use"] for w in health["workers"]},
                "outstanding": {w["worker_id"]: w["outstanding"] for w in health["workers"]}}
        pids = set(child_pids(launcher_pid).values())
        held["kv_frames"] = [p.name for p in Path("/dev/shm").glob("epdserve-kv-*")
                             if int(p.name.split("-")[2]) in pids]
        clean = (not held["requests_in_flight"] and not any(held["blocks_in_use"].values())
                 and not any(held["outstanding"].values()) and not held["kv_frames"])
        if clean or time.monotonic() > deadline:
            return held
        time.sleep(1.0)


def verdicts(records: list[dict], samples: list[dict], kills: list, held: dict, duration_s: float) -> dict:
    killed = {victim for _, victim in kills}
    failed = [r for r in records if r["outcome"] == "failed"]
    on_killed = [r for r in failed if any(f"worker {v} " in (r["error"] or "") for v in killed)]
    others = [r for r in failed if r not in on_killed]
    judged = [p for p in ["router", *WORKERS] if p not in killed]
    rss = {p: growth(samples, p, duration_s, "rss_mb") for p in judged}
    uss = {p: growth(samples, p, duration_s) for p in judged}
    uss_second_half = {p: growth(samples, p, duration_s, since_share=0.5) for p in judged}
    return {
        "requests": len(records), "ok": sum(r["outcome"] == "ok" for r in records),
        "left_by_client": sum(r["outcome"] == "left" for r in records),
        "failed_on_killed_workers": len(on_killed), "failed_otherwise": len(others),
        "failures_otherwise": [r["error"] for r in others][:20],
        "rss_growth": rss, "uss_growth": uss, "uss_growth_second_half": uss_second_half, "held_at_end": held,
        "pass": {"no_other_failures": not others,
                 "rss_growth_under_5pct": all(g is not None and g < 0.05 for g in rss.values()),
                 "no_uss_growth_in_second_half": all(g is not None and g < 0.02 for g in uss_second_half.values()),
                 "nothing_leaked": (not held["requests_in_flight"] and not any(held["blocks_in_use"].values())
                                    and not any(held["outstanding"].values()) and not held["kv_frames"])},
    }


def plot(samples: list[dict], kills: list, duration_s: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for color, process in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], ["router", *WORKERS]):
        mine = [s for s in samples if s["process"] == process]
        if mine:
            t = [s["t_s"] for s in mine]
            ax.plot(t, [s["uss_mb"] for s in mine], label=f"{process} USS", lw=1.4, color=color)
            ax.plot(t, [s["rss_mb"] for s in mine], lw=0.8, ls=":", color=color)
    for t, victim in kills:
        ax.axvline(t, color="red", ls="--", lw=0.8)
        ax.text(t, ax.get_ylim()[1], f" kill -9 {victim}", color="red", va="top", fontsize=8)
    ax.axvspan(0, WARMUP_SHARE * duration_s, color="0.9", label="warm-up")
    ax.set(xlabel="time (s)", ylabel="MiB", title="Soak: private memory (USS, solid) and RSS (dotted) per process")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    out = Path(ARGS.output)
    out.mkdir(parents=True, exist_ok=True)
    port = ARGS.port
    if not port_is_free(port):
        print(f"soak: error: port {port} is in use (--port)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--prefill-workers", "2",
           "--decode-workers", "2", "--port", str(port), "--trace-file", str(out / "soak.server.jsonl")]
    server = ServerProcess("2p2d", cmd, out / "soak.server.log", f"http://127.0.0.1:{port}")
    server.start()
    try:
        server.wait_healthy(600, workers=len(WORKERS))
        duration = ARGS.minutes * 60
        print(f"soak: {ARGS.minutes:g} min at {ARGS.rate:g} req/s, {ARGS.abort_share:.0%} left by the client",
              flush=True)
        t0 = time.monotonic()
        records, samples, kills = asyncio.run(load(server.base_url, duration, server.proc.pid, t0))
        held = leaks(server.base_url, server.proc.pid)
    finally:
        server.stop()
    result = verdicts(records, samples, kills, held, duration)
    plot(samples, kills, duration, out / "soak.png")
    return report(out / "soak.json", {"settings": vars(ARGS), "verdicts": result, "kills": kills,
                                      "requests": records, "rss": samples}, "failures_otherwise")


def report(path: Path, document: dict, failures: str, quiet: tuple[str, ...] = ()) -> int:
    """Write ``document`` to ``path`` (its PNG beside it), print its verdicts but ``quiet`` ones and
    each error its ``failures`` verdict lists; the exit status: 0 when every ``pass`` verdict holds, else 1."""
    verdicts = document["verdicts"]
    path.write_text(json.dumps(document, indent=1))
    print(json.dumps({k: v for k, v in verdicts.items() if k not in (failures, *quiet)}, indent=1))
    for error in verdicts[failures]:
        print("failed:", error)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if all(verdicts["pass"].values()) else 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.3, help="requests per second (Poisson arrivals)")
    parser.add_argument("--abort-share", type=float, default=0.2, help="share of requests the client leaves early")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--output", default="results/soak")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    sys.exit(main())
