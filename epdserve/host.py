"""What this host has and what runs on it, read from ``/proc`` (Linux; no psutil).

* capacity, for ``epdserve serve`` and ``compare`` to refuse a deployment the host cannot
  hold: :func:`mem_available_bytes`, :func:`weight_bytes`;
* load, for ``compare`` to tell when other processes took cores from the deployment it
  measures: :func:`loadavg_1m`, :func:`cpu_ticks` (CPU time by state on given cores, steal
  included), :func:`tree_ticks` (CPU time of a process and its descendants), and
  :class:`LoadMonitor`, which samples them over a run;
* CPU priority, for ``compare``'s client to compete for the cores on the deployment's
  terms: :func:`autogroup_nice`, :func:`match_cpu_priority`; and :func:`client_warning`
  when the client was held up all the same.

CPU times in ``/proc/stat`` and ``/proc/PID/stat`` are in clock ticks (:data:`CLK_TCK` a
second); the functions here return ticks, :class:`LoadMonitor` seconds and shares.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Warn when other processes (and the hypervisor, as steal) took at least this share of the
# deployment's cores during a run. The engine is CPU-bound, so a share taken from it costs
# about as much throughput and latency, and configurations compare measures often differ by
# 10-30%; on a quiet machine the accounting's own noise (kernel threads, tick granularity,
# processes that exit between samples) stays near 1-2%.
OUTSIDE_SHARE_WARN = 0.10


# A send this late after its scheduled time, or an event-loop wake-up this late, is the
# client's own delay, not the deployment's (the TTFT SLOs judged here are 1-10 s).
CLIENT_LATE_S = 0.5


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes: the kernel's estimate of what can be allocated without
    swapping; None where the file or the field is missing (not Linux, kernel < 3.14)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except OSError:
        pass
    return None


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the top-level ``*.safetensors`` files of a Hugging Face model directory:
    the dense weights as stored (float32 for a converted GGUF), which every worker loads
    in full before converting them or keeping only quantized blocks, so a fair estimate of
    a worker's peak weight memory (measured: a SmolLM2-135M worker with 1024 MiB of KV
    cache holds 1.46 GB once up; estimated 0.54 GB + 1024 MiB = 1.61 GB)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def worker_pids(launcher_pid: int, proc: str | Path = "/proc") -> dict[str, int]:
    """Worker id -> pid of each ``epdserve worker`` child of ``launcher_pid`` (an ``epdserve
    serve``), from its ``--worker-id`` argument; a child that exits meanwhile is skipped."""
    pids = {}
    for task in Path(proc, str(launcher_pid), "task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                argv = Path(proc, pid, "cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"--worker-id" in argv:
                pids[argv[argv.index(b"--worker-id") + 1].decode()] = int(pid)
    return pids


def loadavg_1m(path: str | Path = "/proc/loadavg") -> float | None:
    """The 1-minute load average (runnable and uninterruptible threads, ours included,
    exponentially averaged over a minute); None where unreadable."""
    try:
        return float(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_ticks(cores: list[int], stat: str | Path = "/proc/stat") -> dict[str, int]:
    """CPU time of ``cores`` since boot, in clock ticks: ``busy`` (user, nice, system, irq,
    softirq; guest time is inside user), ``steal`` (the hypervisor ran another guest while
    ours wanted the core) and ``total`` (every state). A core absent from the file counts 0.

    Raises:
        OSError: the file cannot be read.
    """
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
    """(user + system CPU time in clock ticks, resident memory in bytes) of ``root_pid`` and
    every live descendant, keyed by ``(pid, start time)`` so that a reused pid is another
    process. Found by parent pid over all of ``/proc``: the launcher's workers leave its
    process group, and their own children (e.g. a compiler building a kernel) count too."""
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
    """The CPU time (clock ticks) of each process of :func:`tree_stats`."""
    return {k: ticks for k, (ticks, _) in tree_stats(root_pid, proc).items()}


def outside_warning(share: float, steal: float, num_cores: int) -> str | None:
    """The warning for a run in which other processes took ``share`` and the hypervisor
    ``steal`` of ``num_cores`` cores' time, or None below :data:`OUTSIDE_SHARE_WARN`."""
    if share + steal < OUTSIDE_SHARE_WARN:
        return None
    return (f"other processes used {share:.0%} of the {num_cores} cores' time during the run "
            f"(CPU steal {steal:.0%}; warning at {OUTSIDE_SHARE_WARN:.0%}): its latencies and "
            f"throughput understate this deployment; rerun on a quiet machine")


def cpu_shares(before: dict, after: dict, own_s: float) -> tuple[float, float, float, float]:
    """(busy s, outside s, outside share, steal share) between two :func:`cpu_ticks` of the
    same cores, of which our own processes used ``own_s`` CPU seconds: outside = busy - own,
    the shares of the cores' whole time (0-1)."""
    total = max(1, after["total"] - before["total"])
    busy_s = (after["busy"] - before["busy"]) / CLK_TCK
    outside_s = max(0.0, busy_s - own_s)
    return busy_s, outside_s, outside_s * CLK_TCK / total, (after["steal"] - before["steal"]) / total


def quiet_check(cores: list[int], window_s: float = 1.0) -> dict:
    """Load on ``cores`` over ``window_s`` seconds before a run (nothing of ours but this
    process runs): ``{"window_s", "loadavg_1m", "outside_share", "steal_share"}``. The load
    average still holds the previous run's load for about a minute; the shares do not."""
    t0, own0, c0 = time.monotonic(), time.process_time(), cpu_ticks(cores)
    time.sleep(window_s)
    _, _, share, steal = cpu_shares(c0, cpu_ticks(cores), time.process_time() - own0)
    return {"window_s": round(time.monotonic() - t0, 3), "loadavg_1m": loadavg_1m(),
            "outside_share": round(share, 4), "steal_share": round(steal, 4)}


class LoadMonitor:
    """Samples, every ``interval_s`` seconds in a thread, the 1-minute load average and the
    CPU time of the process trees under ``root_pids`` (the deployment: each of its processes
    with its children, e.g. a launcher and its workers),
    from :meth:`start` to :meth:`stop`; the CPU time of ``cores`` and of this process (the
    bench client) are read at both ends. Outside load = busy time on ``cores`` minus the
    deployment's and this process's: what other processes used. A process that exits
    between two samples loses at most ``interval_s`` of CPU time from the deployment's."""

    def __init__(self, cores: list[int], root_pids: list[int], interval_s: float = 1.0):
        self.cores, self.root_pids, self.interval_s = cores, list(root_pids), interval_s
        self.loads: list[float] = []
        self.first: dict[tuple[int, int], int] = {}  # process -> its ticks at start (0 if born later)
        self.last: dict[tuple[int, int], int] = {}   # process -> ticks when last seen
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
        """Stop sampling; returns ``{"wall_s", "loadavg_1m_mean", "loadavg_1m_max",
        "busy_cpu_s", "deployment_cpu_s", "client_cpu_s", "outside_cpu_s" (CPU seconds on
        the cores), "outside_share", "steal_share" (of the cores' time, 0-1),
        "deployment_rss_peak_bytes" (the deployment's resident memory at its highest sample)}``."""
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
    """The nice value of the scheduling autogroup of ``pid`` (``/proc/PID/autogroup``,
    "/autogroup-N nice V"); None where the kernel has no autogroups
    (``CONFIG_SCHED_AUTOGROUP`` off) or the process is gone."""
    try:
        fields = Path(proc, str(pid), "autogroup").read_text().split()
        return int(fields[fields.index("nice") + 1])
    except (OSError, ValueError, IndexError):
        return None


def match_cpu_priority(pids: list[int], proc: str | Path = "/proc") -> dict:
    """Give the sessions of ``pids`` (the processes compare started, each the leader of a
    session of its own) this process's autogroup nice value, so that the bench client and
    the deployment it measures get CPU time on the same terms.

    Why: with autogroups (Linux ``CONFIG_SCHED_AUTOGROUP``, on in most distributions) the
    scheduler shares the CPUs between sessions first, by each session's autogroup nice
    (weight 1024 at 0, 15 at 19: ``sched_prio_to_weight``), and only then between the
    processes of a session. A new session starts at nice 0 whatever its parent's, so a
    compare run from a session at nice 19 measured a deployment at 0: next to a busy worker
    its client got about 15/1039 of a core, and on 2 cores both busy with colocated workers
    its event loop stood still for up to 10 s at a time (sends 10 s late, chunks read 10 s
    after the router wrote them: client TTFT 8-19 s for a router TTFT of 0.2-1.5 s).

    Returns ``{"client_autogroup_nice": V or None, "deployment_autogroup_nice": {pid: V},
    "error": None or why a session could not be changed}``; without autogroups nothing is
    changed (each process then has its own nice, which a child inherits)."""
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
    """Write ``nice`` to ``/proc/PID/autogroup``; None, or why it failed. Without
    CAP_SYS_ADMIN the kernel takes one such change every 100 ms in all (EAGAIN before):
    one retry after that; lowering a value needs CAP_SYS_NICE (EPERM)."""
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
    """The warning for a run whose bench client was held up: ``late_sends`` of ``num_sends``
    requests sent at least :data:`CLIENT_LATE_S` after their scheduled time (the latest
    ``max_late_s`` late), its event loop stalled ``stalled_s`` in all (the worst stall
    ``worst_stall_s``, s); None when neither happened. Its TTFT/ITL then include the
    client's own delay, which the server's trace (the TTFT breakdown) does not."""
    if late_sends == 0 and not stalled_s:
        return None
    return (f"the bench client was held up: {late_sends} of {num_sends} requests were sent "
            f"{CLIENT_LATE_S:g} s or more after their scheduled time (at most {max_late_s:.1f} s) and "
            f"its event loop stalled {stalled_s:.1f} s in all (worst {worst_stall_s or 0:.1f} s): "
            f"the client's TTFT and ITL of this run include that delay, which is not the "
            f"deployment's (compare the server trace's TTFT; docs/comparing.md, \"The client's "
            f"own delay\")")
