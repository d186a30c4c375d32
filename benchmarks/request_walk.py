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

``--tree PATH`` puts PATH first on ``PYTHONPATH`` too, so that every process imports that
checkout's ``epdserve`` (the editable install's finder comes after ``PYTHONPATH``); the
deployment runs in a temporary working directory, since ``python -m`` puts the working
directory first on ``sys.path``.

    python benchmarks/request_walk.py [--tree PATH] [--window 5] [--list] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def start_serve(env: dict[str, str], cwd: Path, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """``epdserve serve --mode pd`` on a free port, in its own session, in ``cwd`` (``python
    -m`` puts the working directory first on sys.path: it must hold no checkout); (process,
    URL) once its URL is printed and /health answers 200."""
    argv = [sys.executable, "-m", "epdserve", "serve", "--mode", "pd", "--host", "127.0.0.1", "--port", "0"]
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


def chat(url: str, model: str, prompt: str) -> dict:
    return http_json(url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0})


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
    """Ask every process for its counts (trigger ``snap-K``); pid -> {"FILE\\tQUALNAME\\tLINE": calls}."""
    (directory / f"snap-{k}").touch()
    deadline = time.monotonic() + timeout_s
    paths = {pid: directory / f"{pid}-{k}.json" for pid in pids}
    while not all(p.exists() for p in paths.values()):
        if time.monotonic() > deadline:
            missing = [pid for pid, p in paths.items() if not p.exists()]
            raise RuntimeError(f"no counts from pids {missing} for snapshot {k}")
        time.sleep(0.05)
    return {pid: json.loads(p.read_text())["counts"] for pid, p in paths.items()}


def risen(before: dict, after: dict) -> set[str]:
    return {key for key, n in after.items() if n > before.get(key, 0)}


def measure(directory: Path, url: str, model: str, pids: dict[int, str], window_s: float) -> tuple[list[dict], float]:
    """The three snapshots around an idle window and the request's window; (snapshots, the
    request's seconds)."""
    snaps = [snapshot(directory, 0, pids)]
    time.sleep(window_s)
    snaps.append(snapshot(directory, 1, pids))
    start = time.monotonic()
    reply = chat(url, model, PROMPT)
    took = time.monotonic() - start
    if took > window_s:
        raise RuntimeError(f"the request took {took:.1f} s, longer than --window {window_s} s")
    if reply["usage"]["completion_tokens"] < 1:
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
        idle = risen(snaps[0][pid], snaps[1][pid])
        busy = risen(snaps[1][pid], snaps[2][pid])
        name = role if role not in roles else f"{role}-{pid}"
        roles[name] = {"pid": pid,
                       "functions": sorted(split_key(k, prefix) for k in busy - idle),
                       "also_idle": sorted(split_key(k, prefix) for k in busy & idle),
                       "idle": len(idle)}
    union = sorted({f for r in roles.values() for f in r["functions"]})
    return {"roles": roles, "functions": union, "files": sorted({f[0] for f in union})}


def report(result: dict, show_list: bool) -> None:
    print(f"walk of one PD request ({result['tree']}; windows {result['window_s']} s, "
          f"request {result['request_s']:.2f} s)")
    print(f"  total: {len(result['files'])} files, {len(result['functions'])} functions")
    for role, r in result["roles"].items():
        files = {f[0] for f in r["functions"]}
        print(f"  {role:<8} (pid {r['pid']}): {len(files)} files, {len(r['functions'])} functions"
              f"  (also run while idle, left out: {len(r['also_idle'])}; run while idle: {r['idle']})")
    if not show_list:
        return
    by_role = {role: set(r["functions"]) for role, r in result["roles"].items()}
    for path in result["files"]:
        funcs = [f for f in result["functions"] if f[0] == path]
        print(f"\n{path} ({len(funcs)})")
        for f in funcs:
            where = ",".join(role for role, fs in by_role.items() if f in fs)
            print(f"    {f[1]}:{f[2]}  [{where}]")


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
    log_path = (args.output or work) / "serve.log"
    proc, url = start_serve(env, work, log_path, args.startup_timeout)
    try:
        model = http_json(url + "/v1/models")["data"][0]["id"]
        if args.warmup:
            chat(url, model, WARMUP_PROMPT)
        time.sleep(args.settle)
        pids = deployment_pids(proc.pid)
        if sorted(pids.values()) != sorted(ROLES):
            raise RuntimeError(f"expected one router, prefill and decode process, found {pids}")
        snaps, took = measure(counts, url, model, pids, args.window)
    finally:
        stop_serve(proc)
    result = walk(snaps, pids, prefix)
    result.update(tree=str(tree or Path(prefix).parent), window_s=args.window, request_s=took, warmup=args.warmup)
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
