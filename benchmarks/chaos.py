"""Chaos soak: a PD deployment with two workers of each role under steady load while its workers
die (kill -9) and hang (SIGSTOP), then what that cost the clients.

Load: streamed completions arriving as a Poisson process at ``--rate`` requests/s, each one of
``--prompts`` fixed prompts (30-300 words, 32-160 output tokens, greedy, ``ignore_eos``) whose
fault-free text is read first, one request at a time, on the same deployment.

Faults: every ``--kill-every`` s a random worker is killed with SIGKILL (serve restarts it), and
every ``--stop-every`` s another is stopped for ``--stop-for`` s (SIGSTOP, then SIGCONT: past
``--worker-timeout`` the router takes it for dead, moves its requests, and resets it when it
is heard again). A victim is chosen only among live workers whose role keeps another live one.

Reported: requests sent, completed, failed, moved (the trace's ``migrations``); each completed
text against its fault-free text, and its token count against ``max_tokens`` (a repeated or
missing token shows in both); KV blocks, requests and staged frames left; RSS and USS of every
process over time; TTFT and ITL p99 of requests that met a fault against those that did not; the
cores' busy share over the run (how near its capacity the load ran).
With ``--prometheus``, Debian's Prometheus server scrapes ``/metrics`` every second and the
PromQL of vLLM's Grafana dashboard (every metric ``tests/data/vllm_grafana_metrics.txt`` lists,
in the dashboard's forms: quantiles of histograms, means, rates) and the migration counter are
asked of it at the end.

Goals (exit 1 when one is missed): 0 failed requests, 0 texts or token counts that differ, 0
left, and with ``--minutes`` >= 5 an RSS growth under 5 % for every process that lived at least
half the run since its last kill (the median of the run's last 10 % over the median after the
first 20 % of that life).

    .venv/bin/python benchmarks/chaos.py [--minutes 10] [--rate 0.4] [--prometheus] [--output results/chaos]

Writes ``chaos.json`` and ``chaos.png`` to ``--output``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from epdserve.host import child_pids, cpu_ticks  # noqa: E402
from epdserve.model.kernels import cpu_model  # noqa: E402
from prometheus_scrape import Prometheus, dashboard_queries  # noqa: E402
from soak import WARMUP_SHARE, WORDS, growth, leaks, memory_mb, report  # noqa: E402

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
CORES = sorted(os.sched_getaffinity(0))
JUDGED_MINUTES = 5.0  # shorter runs report memory but do not judge it


def prompt_pool(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 300))),
             "max_tokens": rng.randint(32, 160)} for _ in range(n)]


async def stream(client: httpx.AsyncClient, url: str, job: dict, t0: float) -> dict:
    """One streamed completion: ``text``, ``tokens`` (content events), ``times`` of each (s from
    ``t0``), ``error`` (None, an HTTP status, an error event or a dropped connection)."""
    body = {**job, "temperature": 0, "ignore_eos": True, "stream": True}
    rec = {"start_s": time.monotonic() - t0, "text": "", "tokens": 0, "times": [], "error": None, "id": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec["error"] = data["error"]["message"]
                    break
                rec["id"] = data["id"]
                rec["text"] += data["choices"][0]["text"]
                rec["tokens"] += 1
                rec["times"].append(time.monotonic() - t0)
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["end_s"] = time.monotonic() - t0
    return rec


async def references(url: str, pool: list[dict]) -> list[str]:
    """Each prompt's fault-free text, one request at a time."""
    async with httpx.AsyncClient() as client:
        out = []
        for job in pool:
            rec = await stream(client, url, job, time.monotonic())
            if rec["error"] or rec["tokens"] != job["max_tokens"]:
                raise RuntimeError(f"the fault-free run failed: {rec['error'] or rec['tokens']}")
            out.append(rec["text"])
        return out


class Faults:
    """The kills and stops, each ``{"kind", "worker", "start_s", "end_s"}``: ``end_s`` when the
    worker was live again in ``/health`` (None: not by the end)."""

    def __init__(self, url: str, launcher_pid: int, rng: random.Random):
        self.url, self.launcher_pid, self.rng = url, launcher_pid, rng
        self.log: list[dict] = []
        self.stopped: set[str] = set()

    def victim(self, health: dict) -> str | None:
        live = {w["worker_id"]: w["role"] for w in health["workers"] if w["state"] == "up"}
        live = {w: r for w, r in live.items() if w not in self.stopped}
        spare = [w for w, role in live.items() if sum(r == role for r in live.values()) > 1]
        return self.rng.choice(sorted(spare)) if spare else None

    async def act(self, kind: str, t0: float, stop_for: float) -> None:
        async with httpx.AsyncClient() as client:
            worker = self.victim((await client.get(self.url + "/health", timeout=10)).json())
            if worker is None:
                print(f"[{time.monotonic() - t0:6.1f} s] {kind}: no worker can go (each role keeps one)", flush=True)
                return
            pid = child_pids(self.launcher_pid)[worker]
            entry = {"kind": kind, "worker": worker, "start_s": time.monotonic() - t0, "end_s": None}
            self.log.append(entry)
            print(f"[{entry['start_s']:6.1f} s] {kind} {worker}", flush=True)
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(1.0)  # let the router see it go
            else:
                self.stopped.add(worker)
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(stop_for)
                os.kill(pid, signal.SIGCONT)
                self.stopped.discard(worker)
            while entry["end_s"] is None:
                health = (await client.get(self.url + "/health", timeout=10)).json()
                if any(w["worker_id"] == worker and w["state"] == "up" for w in health["workers"]):
                    entry["end_s"] = time.monotonic() - t0
                await asyncio.sleep(0.2)

    def resume_all(self) -> None:
        pids = child_pids(self.launcher_pid)
        for worker in self.stopped:
            os.kill(pids[worker], signal.SIGCONT)


async def load(url: str, pool: list[dict], launcher_pid: int, t0: float) -> tuple[list[dict], list[dict], Faults]:
    """Requests, faults and memory samples for ``--minutes``; the requests in flight at the end
    are awaited."""
    rng = random.Random(ARGS.seed)
    faults = Faults(url, launcher_pid, random.Random(ARGS.seed + 1))
    duration = ARGS.minutes * 60
    tasks, actions, samples = [], [], []
    next_arrival, next_kill, next_stop, next_sample = 0.0, ARGS.kill_every, ARGS.stop_every, 0.0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
        try:
            while (now := time.monotonic() - t0) < duration:
                if now >= next_arrival:
                    i = rng.randrange(len(pool))
                    tasks.append((i, asyncio.create_task(stream(client, url, pool[i], t0))))
                    next_arrival = now + rng.expovariate(ARGS.rate)
                if now >= next_kill:
                    actions.append(asyncio.create_task(faults.act("kill", t0, 0)))
                    next_kill = now + ARGS.kill_every
                if now >= next_stop:
                    actions.append(asyncio.create_task(faults.act("stop", t0, ARGS.stop_for)))
                    next_stop = now + ARGS.stop_every
                if now >= next_sample:
                    pids = {"serve": launcher_pid, **child_pids(launcher_pid)}
                    samples += [{"t_s": now, "process": name, "rss_mb": mb[0], "uss_mb": mb[1]}
                                for name, pid in pids.items() if (mb := memory_mb(pid)) is not None]
                    next_sample = now + 5.0
                await asyncio.sleep(0.05)
            await asyncio.gather(*actions)
        finally:
            faults.resume_all()
        records = [dict(await task, prompt=i) for i, task in tasks]
    return records, samples, faults


def p99(values: list[float]) -> float | None:
    return round(statistics.quantiles(values, n=100)[98] * 1e3, 1) if len(values) >= 2 else None


def latencies(records: list[dict], faults: list[dict], end_s: float) -> dict:
    """TTFT and ITL p99 (ms) of requests that overlapped a fault (from its start until the worker
    was live again) and of the others."""
    windows = [(f["start_s"], f["end_s"] or end_s) for f in faults]

    def met(r: dict) -> bool:
        return any(a <= r["end_s"] and r["start_s"] <= b for a, b in windows)

    out = {}
    for name, group in (("during_faults", [r for r in records if met(r)]),
                        ("quiet", [r for r in records if not met(r)])):
        done = [r for r in group if r["times"]]
        out[name] = {"requests": len(group),
                     "ttft_p99_ms": p99([r["times"][0] - r["start_s"] for r in done]),
                     "itl_p99_ms": p99([b - a for r in done for a, b in zip(r["times"], r["times"][1:])])}
    return out


def migrations(trace_path: Path) -> dict[str, list]:
    """Response id -> its moves, from the trace file."""
    moves = {}
    for line in trace_path.read_text().splitlines() if trace_path.exists() else []:
        rec = json.loads(line)
        if rec.get("migrations"):
            moves[rec["request_id"]] = rec["migrations"]
    return moves


def rss_growth(samples: list[dict], faults: list[dict], duration_s: float) -> dict[str, float | None]:
    """RSS growth of each process that lived at least half the run since its last restart (a kill):
    the median of the run's last 10 % over the median of the 15 s after the first 20 % of that life."""
    out = {}
    for process in ("router", *WORKERS):
        born = max([f["start_s"] for f in faults if f["kind"] == "kill" and f["worker"] == process], default=0.0)
        if born <= duration_s / 2:
            out[process] = growth(samples, process, duration_s, "rss_mb",
                                  since_share=(born + WARMUP_SHARE * (duration_s - born)) / duration_s)
    return out


def verdicts(records: list[dict], refs: list[str], pool: list[dict], faults: Faults, samples: list[dict],
             held: dict, moves: dict, duration_s: float) -> dict:
    failed = [r for r in records if r["error"]]
    done = [r for r in records if not r["error"]]
    wrong = [r for r in done if r["text"] != refs[r["prompt"]] or r["tokens"] != pool[r["prompt"]]["max_tokens"]]
    rss = rss_growth(samples, faults.log, duration_s)
    judge_memory = ARGS.minutes >= JUDGED_MINUTES
    return {
        "requests": len(records), "completed": len(done), "failed": len(failed),
        "failures": [r["error"] for r in failed][:20], "migrated": sum(r["id"] in moves for r in done),
        "tokens_checked": sum(r["tokens"] for r in done), "texts_differing": len(wrong),
        "differing": [{"prompt": r["prompt"], "tokens": r["tokens"], "text": r["text"][:200]} for r in wrong][:10],
        "kills": sum(f["kind"] == "kill" for f in faults.log), "stops": sum(f["kind"] == "stop" for f in faults.log),
        "latency": latencies(records, faults.log, duration_s), "rss_growth": rss, "held_at_end": held,
        "pass": {"no_failed_requests": not failed, "no_differing_text": not wrong,
                 "nothing_left": (not held["requests_in_flight"] and not any(held["blocks_in_use"].values())
                                  and not any(held["outstanding"].values()) and not held["kv_frames"]),
                 **({"rss_growth_under_5pct": all(g is not None and g < 0.05 for g in rss.values())}
                    if judge_memory else {})},
    }


def plot(records: list[dict], samples: list[dict], faults: list[dict], path: Path) -> None:
    fig, (mem, ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for process in ("router", *WORKERS):
        mine = [s for s in samples if s["process"] == process]
        if mine:
            mem.plot([s["t_s"] for s in mine], [s["rss_mb"] for s in mine], label=f"{process} RSS", lw=1.2)
    done = [r for r in records if r["times"]]
    ttft.scatter([r["start_s"] for r in done], [(r["times"][0] - r["start_s"]) * 1e3 for r in done], s=8,
                 label="completed")
    failed = [r for r in records if r["error"]]
    bottom = min([(r["times"][0] - r["start_s"]) * 1e3 for r in done] or [1.0]) / 2
    ttft.scatter([r["start_s"] for r in failed], [bottom] * len(failed), s=20, marker="x", color="red",
                 label="failed (drawn at the bottom)")
    for f in faults:
        for ax in (mem, ttft):
            ax.axvspan(f["start_s"], f["end_s"] or f["start_s"] + 1, color="red" if f["kind"] == "kill" else "orange",
                       alpha=0.15)
        mem.text(f["start_s"], mem.get_ylim()[1], f" {f['kind']} {f['worker']}", fontsize=7, va="top")
    mem.set(ylabel="MiB", title=f"Chaos soak on {cpu_model()}: RSS per process; faults shaded (kill red, stop orange)")
    ttft.set(xlabel="time (s)", ylabel="TTFT (ms)", yscale="log")
    mem.legend(fontsize=7, loc="lower right")
    ttft.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    out = Path(ARGS.output)
    out.mkdir(parents=True, exist_ok=True)
    if not port_is_free(ARGS.port):
        print(f"chaos: error: port {ARGS.port} is in use (--port)", file=sys.stderr)
        return 2
    trace = out / "chaos.server.jsonl"
    trace.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--prefill-workers", "2", "--decode-workers",
           "2", "--port", str(ARGS.port), "--trace-file", str(trace), "--kv-cache-memory-mb", "256"]
    server = ServerProcess("2p2d", cmd, out / "chaos.server.log", f"http://127.0.0.1:{ARGS.port}")
    prometheus = Prometheus(out / "prometheus", ARGS.port) if ARGS.prometheus else None
    server.start()
    try:
        server.wait_healthy(600, workers=len(WORKERS))
        if prometheus:
            prometheus.start()
        pool = prompt_pool(ARGS.prompts, ARGS.seed)
        refs = asyncio.run(references(server.base_url, pool))
        print(f"chaos on {cpu_model()}: {ARGS.minutes:g} min at {ARGS.rate:g} req/s; kill -9 every {ARGS.kill_every:g} s, "
              f"SIGSTOP for {ARGS.stop_for:g} s every {ARGS.stop_every:g} s", flush=True)
        t0, ticks = time.monotonic(), cpu_ticks(CORES)
        records, samples, faults = asyncio.run(load(server.base_url, pool, server.proc.pid, t0))
        after = cpu_ticks(CORES)
        busy = (after["busy"] - ticks["busy"]) / max(1, after["total"] - ticks["total"])
        queries = prometheus.ask(dashboard_queries(server.base_url)) if prometheus else None
        held = leaks(server.base_url, server.proc.pid)
    finally:
        if prometheus:
            prometheus.stop()
        server.stop()
    result = verdicts(records, refs, pool, faults, samples, held, migrations(trace), ARGS.minutes * 60)
    result["cores_busy"] = round(busy, 3)  # the load's share of the cores' time: how near capacity it ran
    if queries is not None:
        result["prometheus"] = queries
        result["pass"]["dashboard_queries_answered"] = all(q["series"] for q in queries)
    plot(records, samples, faults.log, out / "chaos.png")
    return report(out / "chaos.json", {"cpu": cpu_model(), "settings": vars(ARGS), "verdicts": result,
                                       "faults": faults.log, "requests": records, "memory": samples},
                  "failures", quiet=("differing", "prometheus"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second (Poisson arrivals)")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts, each with its fault-free text")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between two kill -9")
    parser.add_argument("--stop-every", type=float, default=90.0, help="seconds between two SIGSTOPs")
    parser.add_argument("--stop-for", type=float, default=15.0, help="seconds a stopped worker stays stopped")
    parser.add_argument("--prometheus", action="store_true", help="scrape with Debian's Prometheus and query it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--output", default="results/chaos")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    sys.exit(main())
