"""Host capacity, load and CPU priority from ``/proc`` (Linux, no psutil); CPU times in ticks (:data:`CLK_TCK`)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Outside share that warns: the engine is CPU-bound, configs differ by 10-30%, quiet-machine noise is ~1-2%.
OUTSIDE_SHARE_WARN = 0.10


# Sends or wake-ups this late are the client's own delay (the TTFT SLOs judged are 1-10 s).
CLIENT_LATE_S = 0.5


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes; None where missing (not Linux, kernel < 3.14)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    return None


def weight_bytes(model_dir: str | Path) -> int:
    """Top-level ``*.safetensors`` bytes, loaded in full by every worker (SmolLM2-135M: 1.46 GB seen, 1.61 est.)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def child_pids(launcher_pid: int, proc: str | Path = "/proc") -> dict[str, int]:
    """Serve's children: each worker by its ``--worker-id``, its router process (forked from serve, so
    with serve's command line) as "router"; children exiting meanwhile are skipped."""
    pids = {}
    for task in Path(proc, str(launcher_pid), "task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                argv = Path(proc, pid, "cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"--worker-id" in argv:
                pids[argv[argv.index(b"--worker-id") + 1].decode()] = int(pid)
            else:
                pids["router"] = int(pid)
    return pids


def loadavg_1m(path: str | Path = "/proc/loadavg") -> float | None:
    """None where unreadable."""
    try:
        return float(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_ticks(cores: list[int], stat: str | Path = "/proc/stat") -> dict[str, int]:
    """``busy`` (user, nice, system, irq, softirq), ``steal``, ``total`` of ``cores`` since boot. Raises OSError."""
    wanted = {f"cpu{c}" for c in cores}
    busy = steal = total = 0
    for line in Path(stat).read_text().splitlines():
        name, *fields = line.split()
        if name not in wanted:
            continue
        # user nice system idle iowait irq softirq steal guest guest_nice
        v = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
        busy += v[0] + v[1] + v[2] + v[5] + v[6]
        steal += v[7]
        total += sum(v)
    return {"busy": busy, "steal": steal, "total": total}


def tree_stats(root_pid: int, proc: str | Path = "/proc") -> dict[tuple[int, int], tuple[int, int]]:
    """``(pid, start time)`` → (CPU ticks, RSS bytes) of ``root_pid``'s tree, by parent pid over all of ``/proc``."""
    parent, stats = {}, {}
    for entry in Path(proc).iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # after "(comm)": state ppid ... utime(12th) stime(13th) ... starttime(20th) vsize rss(22nd)
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        stats[(pid, int(fields[19]))] = (int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE_BYTES)
    tree, grew = {root_pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return {k: v for k, v in stats.items() if k[0] in tree}


def tree_ticks(root_pid: int, proc: str | Path = "/proc") -> dict[tuple[int, int], int]:
    return {k: ticks for k, (ticks, _) in tree_stats(root_pid, proc).items()}


def outside_warning(share: float, steal: float, num_cores: int) -> str | None:
    """None below :data:`OUTSIDE_SHARE_WARN`."""
    if share + steal < OUTSIDE_SHARE_WARN:
        return None
    return (f"other processes used {share:.0%} of the {num_cores} cores' time during the run "
            f"(CPU steal {steal:.0%}; warning at {OUTSIDE_SHARE_WARN:.0%}): its latencies and "
            f"throughput understate this deployment; rerun on a quiet machine")


def cpu_shares(before: dict, after: dict, own_s: float) -> tuple[float, float, float, float]:
    """(busy s, outside s, outside share, steal share); outside = busy - ``own_s``; shares of the cores' time."""
    total = max(1, after["total"] - before["total"])
    busy_s = (after["busy"] - before["busy"]) / CLK_TCK
    outside_s = max(0.0, busy_s - own_s)
    return busy_s, outside_s, outside_s * CLK_TCK / total, (after["steal"] - before["steal"]) / total


def quiet_check(cores: list[int], window_s: float = 1.0) -> dict:
    """Before a run; the load average still holds the previous run's for a minute, the shares do not."""
    t0, own0, c0 = time.monotonic(), time.process_time(), cpu_ticks(cores)
    time.sleep(window_s)
    _, _, share, steal = cpu_shares(c0, cpu_ticks(cores), time.process_time() - own0)
    return {"window_s": round(time.monotonic() - t0, 3), "loadavg_1m": loadavg_1m(),
            "outside_share": round(share, 4), "steal_share": round(steal, 4)}


class LoadMonitor:
    """Samples load and the trees under ``root_pids`` every ``interval_s``; outside = busy on ``cores`` less theirs."""

    def __init__(self, cores: list[int], root_pids: list[int], interval_s: float = 1.0):
        self.cores, self.root_pids, self.interval_s = cores, list(root_pids), interval_s
        self.loads: list[float] = []
        self.first: dict[tuple[int, int], int] = {}  # process -> its ticks at start (0 if born later)
        self.last: dict[tuple[int, int], int] = {}
        self.peak_rss = 0  # bytes: the most the trees held resident at one sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epdserve-loadmonitor", daemon=True)

    def _sample(self) -> None:
        load = loadavg_1m()
        if load is not None:
            self.loads.append(load)
        stats = self._stats()
        for key, (ticks, _) in stats.items():
            self.first.setdefault(key, 0)  # born during the run: all its CPU time is the run's
            self.last[key] = ticks
        self.peak_rss = max(self.peak_rss, sum(rss for _, rss in stats.values()))

    def _stats(self) -> dict[tuple[int, int], tuple[int, int]]:
        return {k: v for pid in self.root_pids for k, v in tree_stats(pid).items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "LoadMonitor":
        self.t0, self.own0, self.cpu0 = time.monotonic(), time.process_time(), cpu_ticks(self.cores)
        self.first = {k: ticks for k, (ticks, _) in self._stats().items()}  # used before the run
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """CPU seconds (busy, deployment, client, outside), shares (0-1), load averages, peak deployment RSS."""
        self._stop.set()
        self._thread.join()
        self._sample()
        client_s = time.process_time() - self.own0
        deployment_s = sum(t - self.first[k] for k, t in self.last.items()) / CLK_TCK
        busy_s, outside_s, share, steal = cpu_shares(self.cpu0, cpu_ticks(self.cores), deployment_s + client_s)
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"wall_s": r(time.monotonic() - self.t0),
                "loadavg_1m_mean": r(sum(self.loads) / len(self.loads)) if self.loads else None,
                "loadavg_1m_max": max(self.loads, default=None),
                "busy_cpu_s": r(busy_s), "deployment_cpu_s": r(deployment_s), "client_cpu_s": r(client_s),
                "outside_cpu_s": r(outside_s), "outside_share": r(share), "steal_share": r(steal),
                "deployment_rss_peak_bytes": self.peak_rss}


def autogroup_nice(pid: int | str = "self", proc: str | Path = "/proc") -> int | None:
    """``/proc/PID/autogroup``'s nice; None without autogroups (``CONFIG_SCHED_AUTOGROUP``) or a gone process."""
    try:
        fields = Path(proc, str(pid), "autogroup").read_text().split()
        return int(fields[fields.index("nice") + 1])
    except (OSError, ValueError, IndexError):
        return None


def match_cpu_priority(pids: list[int], proc: str | Path = "/proc") -> dict:
    """Give ``pids``' sessions our autogroup nice (no autogroups: no change): CPUs go to sessions first by that nice
    (weight 1024 at 0, 15 at 19), so a client at 19 beside a new session (0) once got ~15/1039 of a core."""
    ours = autogroup_nice("self", proc)
    theirs, error = {}, None
    for pid in pids:
        now = autogroup_nice(pid, proc)
        if ours is not None and now is not None and now != ours:
            error = _set_autogroup_nice(pid, ours, proc) or error
            now = autogroup_nice(pid, proc)
        theirs[pid] = now
    return {"client_autogroup_nice": ours, "deployment_autogroup_nice": theirs, "error": error}


def _set_autogroup_nice(pid: int, nice: int, proc: str | Path) -> str | None:
    """None or why not. Without CAP_SYS_ADMIN one change per 100 ms (EAGAIN: one retry); lowering: CAP_SYS_NICE."""
    for attempt in (1, 2):
        try:
            Path(proc, str(pid), "autogroup").write_text(str(nice))
            return None
        except OSError as exc:
            if exc.errno != errno.EAGAIN or attempt == 2:
                return f"cannot set the autogroup nice of pid {pid} to {nice}: {exc.strerror or exc}"
            time.sleep(0.11)  # the second attempt returns either way


def client_warning(late_sends: int, num_sends: int, max_late_s: float, stalled_s: float,
                   worst_stall_s: float | None) -> str | None:
    """None unless sends were :data:`CLIENT_LATE_S` late or the loop stalled (client delay, not in the trace)."""
    if late_sends == 0 and not stalled_s:
        return None
    return (f"the bench client was held up: {late_sends} of {num_sends} requests were sent "
            f"{CLIENT_LATE_S:g} s or more after their scheduled time (at most {max_late_s:.1f} s) and "
            f"its event loop stalled {stalled_s:.1f} s in all (worst {worst_stall_s or 0:.1f} s): "
            f"the client's TTFT and ITL of this run include that delay, which is not the "
            f"deployment's (compare the server trace's TTFT; docs/comparing.md, \"The client's "
            f"own delay\")")
