"""The walk of one PD request: how many files and functions of the ``epdserve`` package run,
across all the processes of a deployment, to serve one chat completion.

Method: ``epdserve serve --mode pd`` (the default model, a free port) starts with a
temporary directory first on ``PYTHONPATH`` holding a ``sitecustomize`` (a copy of
``benchmarks/walk_sitecustomize.py``), so that every Python process of the deployment (the
launcher with its router, and the prefill and decode workers, ``python -m epdserve worker``
children that inherit the environment) counts the calls of each epdserve function
(``sys.setprofile`` / ``threading.setprofile``; file, qualified name, first line) and writes
its counts when a trigger file appears. Once the deployment is up and has settled:

* snapshot 0, an idle window of ``--window`` seconds, snapshot 1;
* one chat completion (``max_tokens`` 16, temperature 0, not streamed), then waiting until
  this window is as long as the idle one, snapshot 2.

The walk of a process = the functions whose count rose in the request window minus those
whose count rose in the idle window (heartbeats, polling loops, metrics). The total is the
union over the processes; a process's role (router, prefill, decode) is read from its
command line (``/proc/<pid>/cmdline``).

Limits: a function that runs both for the request and while idle (a socket send shared
with heartbeats, an event loop step) is left out of the walk; their number is printed as
"also run while idle". Work that runs less often than once per window (a periodic task with
a longer period) can fall into one window and not the other: it shows as noise in the walk
(or in what is left out); longer windows make that rarer. A call is counted where Python
code of the package runs: work done in C (torch operators, ZeroMQ) or in other packages is
not counted, and a result served from a cache (``functools.lru_cache``) does not call the
function again. The first request after start-up also walks lazy initialization (one-time
set-up on first use); ``--warmup`` sends one other request before the windows to leave that
out. The profile hook slows every process (start-up most), not what is counted.

``--stays`` also prints the router's stays: the order in which the request's work in the
router process first enters each epdserve function, from the first call of ``--stays-from``
(default ``Completions.serve``) to the end of the request window, its consecutive
functions of one file forming one stay; a stay in a file an earlier stay left is a revisit.
The request's work is that of the asyncio tasks and threads that ran epdserve code in the
request window and not in the idle one (the events loop and heartbeats are left out).
``--stream`` sends the chat completion streamed; ``--body JSON`` adds fields to it and
``--serve-args`` options to ``serve`` (tools, guided output).

``--tree PATH`` puts PATH first on ``PYTHONPATH`` too, so that every process imports that
checkout's ``epdserve`` (the editable install's finder comes after ``PYTHONPATH``); the
deployment runs in a temporary working directory, since ``python -m`` puts the working
directory first on ``sys.path``.

    python benchmarks/request_walk.py [--tree PATH] [--window 5] [--list] [--output DIR]
        [--stays [--stays-from QUALNAME]] [--stream] [--body JSON] [--serve-args "ARGS"]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
READY = re.compile(r"epdserve serve: ready at (http://\S+)")
ROLES = ("router", "prefill", "decode")
PROMPT = "Name three colours of the rainbow."
WARMUP_PROMPT = "Count from one to five in French, please."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, help="a checkout whose epdserve to run (first on PYTHONPATH)")
    p.add_argument("--window", type=float, default=5.0, help="seconds of each window (default 5)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle after start-up before snapshot 0")
    p.add_argument("--warmup", action="store_true", help="send one other request before the windows")
    p.add_argument("--list", action="store_true", help="print the walk's functions grouped by file")
    p.add_argument("--output", type=Path, help="write walk.json (and the serve log) into this directory")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--stays", action="store_true", help="print the router's stays and revisits")
    p.add_argument("--stays-from", default="Completions.serve", help="the stays start at this qualname's first call")
    p.add_argument("--stream", action="store_true", help="send the measured chat completion streamed")
    p.add_argument("--body", type=json.loads, default={}, help="JSON fields added to the measured request")
    p.add_argument("--serve-args", type=shlex.split, default=[], help="more options for epdserve serve")
    return p.parse_args(argv)


def walk_env(hooks: Path, tree: Path | None) -> dict[str, str]:
    """The environment of the deployment without the counting switched on: the hook
    directory (and ``tree``) first on ``PYTHONPATH``."""
    inherited = filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    paths = [str(hooks), *([str(tree)] if tree else []), *inherited]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    for name in ("EPDSERVE_WALK_DIR", "EPDSERVE_WALK_PREFIX"):
        env.pop(name, None)
    return env


def package_prefix(env: dict[str, str], tree: Path | None, cwd: Path) -> str:
    """The directory of the epdserve package those processes import (with a trailing
    separator); with ``tree``, it must be that checkout's."""
    out = subprocess.run([sys.executable, "-c", "import epdserve, os; print(os.path.dirname(epdserve.__file__))"],
                         env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    if tree is not None and Path(out) != tree / "epdserve":
        raise SystemExit(f"epdserve comes from {out}, not from --tree {tree}")
    return out.rstrip(os.sep) + os.sep


def start_serve(env: dict[str, str], cwd: Path, log_path: Path, timeout_s: float,
                extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """``epdserve serve --mode pd`` on a free port, in its own session, in ``cwd`` (``python
    -m`` puts the working directory first on sys.path: it must hold no checkout); (process,
    URL) once its URL is printed and /health answers 200."""
    argv = [sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--host", "127.0.0.1", "--port", "0", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        match = READY.search(log_path.read_text(errors="replace"))
        if match:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"serve not ready (exit status {proc.poll()}):\n{tail}")
        time.sleep(0.3)
    url = match.group(1)
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"/health at {url} never answered 200")


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its workers); SIGKILL its process group if it hangs
    or left anything behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def chat(url: str, model: str, prompt: str, stream: bool = False, extra: dict | None = None) -> dict:
    """The answer, or a streamed one's chunks as ``{"chunks": [...]}`` (``data: [DONE]`` left out)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
            "temperature": 0, **(extra or {}), **({"stream": True} if stream else {})}
    if not stream:
        return http_json(url + "/v1/chat/completions", body)
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    return {"chunks": [json.loads(e) for e in events if e != "[DONE]"]}


def generated(reply: dict) -> bool:
    """Whether the answer (or a streamed one's chunks) carries generated output."""
    if "chunks" not in reply:
        return reply["usage"]["completion_tokens"] > 0
    return any(c["choices"] and any(v for k, v in c["choices"][0]["delta"].items() if k != "role")
               for c in reply["chunks"])


def role_of(argv: list[str]) -> str | None:
    """The role of a deployment process from its command line (None: not one of them)."""
    if "epdserve" not in argv:
        return None
    if "serve" in argv:
        return "router"
    if "--role" in argv and argv.index("--role") + 1 < len(argv):
        return argv[argv.index("--role") + 1]
    return None


def deployment_pids(session: int) -> dict[int, str]:
    """The epdserve processes of session ``session`` (the launcher's): pid -> role."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == session and (role := role_of(argv)):
            found[int(entry.name)] = role
    return found


def snapshot(directory: Path, k: int, pids: dict[int, str], timeout_s: float = 60.0) -> dict[int, dict]:
    """Ask every process for its counts (trigger ``snap-K``); pid -> {"counts": {"FILE\\tQUALNAME\\tLINE": calls},
    "order": ...} (see walk_sitecustomize.py)."""
    (directory / f"snap-{k}").touch()
    deadline = time.monotonic() + timeout_s
    paths = {pid: directory / f"{pid}-{k}.json" for pid in pids}
    while not all(p.exists() for p in paths.values()):
        if time.monotonic() > deadline:
            missing = [pid for pid, p in paths.items() if not p.exists()]
            raise RuntimeError(f"no counts from pids {missing} for snapshot {k}")
        time.sleep(0.05)
    return {pid: json.loads(p.read_text()) for pid, p in paths.items()}


def risen(before: dict, after: dict) -> set[str]:
    return {key for key, n in after.items() if n > before.get(key, 0)}


def measure(directory: Path, url: str, model: str, pids: dict[int, str],
            args: argparse.Namespace) -> tuple[list[dict], float]:
    """The three snapshots around an idle window and the request's window; (snapshots, the
    request's seconds)."""
    window_s = args.window
    snaps = [snapshot(directory, 0, pids)]
    time.sleep(window_s)
    snaps.append(snapshot(directory, 1, pids))
    start = time.monotonic()
    reply = chat(url, model, PROMPT, args.stream, args.body)
    took = time.monotonic() - start
    if took > window_s:
        raise RuntimeError(f"the request took {took:.1f} s, longer than --window {window_s} s")
    if not generated(reply):
        raise RuntimeError(f"no tokens generated: {reply}")
    time.sleep(window_s - took)
    snaps.append(snapshot(directory, 2, pids))
    return snaps, took


def split_key(key: str, prefix: str) -> tuple[str, str, int]:
    """("FILE\\tQUALNAME\\tLINE") -> (file relative to the package's parent, qualname, line)."""
    path, qualname, line = key.split("\t")
    return "epdserve/" + path[len(prefix):], qualname, int(line)


def walk(snaps: list[dict], pids: dict[int, str], prefix: str) -> dict:
    """Per role: the functions in the walk and those left out as also run while idle;
    and the union of the walks."""
    roles: dict[str, dict] = {}
    for pid, role in sorted(pids.items(), key=lambda kv: ROLES.index(kv[1]) if kv[1] in ROLES else 9):
        idle = risen(snaps[0][pid]["counts"], snaps[1][pid]["counts"])
        busy = risen(snaps[1][pid]["counts"], snaps[2][pid]["counts"])
        name = role if role not in roles else f"{role}-{pid}"
        roles[name] = {"pid": pid,
                       "functions": sorted(split_key(k, prefix) for k in busy - idle),
                       "also_idle": sorted(split_key(k, prefix) for k in busy & idle),
                       "idle": len(idle)}
    union = sorted({f for r in roles.values() for f in r["functions"]})
    return {"roles": roles, "functions": union, "files": sorted({f[0] for f in union})}


def request_calls(snaps: list[dict], pid: int, prefix: str) -> list[tuple[str, str, int]]:
    """The first calls, in order, of the functions the request's work ran in process ``pid``
    (tasks and threads that ran none in the idle window), each function once."""
    idle = {ctx for ctx, _ in snaps[1][pid]["order"]}
    keys = [key for ctx, key in snaps[2][pid]["order"] if ctx not in idle]
    return [split_key(key, prefix) for key in dict.fromkeys(keys)]


def stays(calls: list[tuple[str, str, int]], start: str) -> list[dict]:
    """The stays from ``start``'s first call (see the docstring): ``[{"file", "functions":
    [qualname, ...], "revisit": bool}, ...]``."""
    first = next((i for i, (_, qualname, _) in enumerate(calls) if qualname == start), None)
    if first is None:
        raise RuntimeError(f"no call of {start} in the router's request window")
    out: list[dict] = []
    for path, qualname, _ in calls[first:]:
        if out and out[-1]["file"] == path:
            out[-1]["functions"].append(qualname)
        else:
            out.append({"file": path, "functions": [qualname], "revisit": any(s["file"] == path for s in out)})
    return out


def report(result: dict, show_list: bool) -> None:
    print(f"walk of one PD request ({result['tree']}; windows {result['window_s']} s, "
          f"request {result['request_s']:.2f} s)")
    print(f"  total: {len(result['files'])} files, {len(result['functions'])} functions")
    for role, r in result["roles"].items():
        files = {f[0] for f in r["functions"]}
        print(f"  {role:<8} (pid {r['pid']}): {len(files)} files, {len(r['functions'])} functions"
              f"  (also run while idle, left out: {len(r['also_idle'])}; run while idle: {r['idle']})")
    if result.get("stays") is not None:
        report_stays(result["stays"])
    if not show_list:
        return
    by_role = {role: set(r["functions"]) for role, r in result["roles"].items()}
    for path in result["files"]:
        funcs = [f for f in result["functions"] if f[0] == path]
        print(f"\n{path} ({len(funcs)})")
        for f in funcs:
            where = ",".join(role for role, fs in by_role.items() if f in fs)
            print(f"    {f[1]}:{f[2]}  [{where}]")


def report_stays(walked: list[dict]) -> None:
    files = {s["file"] for s in walked}
    again = [s for s in walked if s["revisit"]]
    print(f"  router stays: {len(files)} files, {len(walked)} stays, {len(again)} revisits")
    for k, s in enumerate(walked, 1):
        mark = " (revisit)" if s["revisit"] else ""
        print(f"    {k:>3} {s['file']}{mark}: {', '.join(s['functions'])}")
    by_file = {f: sum(s["file"] == f for s in again) for f in files}
    print("  revisits by file: " + (", ".join(f"{f} {n}" for f, n in sorted(by_file.items(), key=lambda kv: -kv[1])
                                              if n) or "none"))


def run(args: argparse.Namespace, work: Path) -> dict:
    """Start the deployment with the hooks, measure, stop it (on every exit path)."""
    hooks, counts = work / "hooks", work / "counts"
    hooks.mkdir()
    counts.mkdir()
    shutil.copy(HERE / "walk_sitecustomize.py", hooks / "sitecustomize.py")
    tree = args.tree.resolve() if args.tree else None
    env = walk_env(hooks, tree)
    prefix = package_prefix(env, tree, work)
    env.update(EPDSERVE_WALK_DIR=str(counts), EPDSERVE_WALK_PREFIX=prefix)
    if args.stays:
        env["EPDSERVE_WALK_ORDER"] = "serve"  # the router's process (see role_of)
    log_path = (args.output or work) / "serve.log"
    proc, url = start_serve(env, work, log_path, args.startup_timeout, args.serve_args)
    try:
        model = http_json(url + "/v1/models")["data"][0]["id"]
        if args.warmup:
            chat(url, model, WARMUP_PROMPT, args.stream, args.body)
        time.sleep(args.settle)
        pids = deployment_pids(proc.pid)
        if sorted(pids.values()) != sorted(ROLES):
            raise RuntimeError(f"expected one router, prefill and decode process, found {pids}")
        snaps, took = measure(counts, url, model, pids, args)
    finally:
        stop_serve(proc)
    result = walk(snaps, pids, prefix)
    result.update(tree=str(tree or Path(prefix).parent), window_s=args.window, request_s=took, warmup=args.warmup,
                  stream=args.stream, body=args.body)
    if args.stays:
        router = next(pid for pid, role in pids.items() if role == "router")
        result["router_calls"] = request_calls(snaps, router, prefix)
        result["stays"] = stays(result["router_calls"], args.stays_from)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="request-walk-") as tmp:
        result = run(args, Path(tmp))
    report(result, args.list)
    if args.output:
        (args.output / "walk.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output / 'walk.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
