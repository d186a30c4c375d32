"""The ``sitecustomize`` that ``benchmarks/request_walk.py`` puts first on ``PYTHONPATH`` (copied
into a temporary directory under that name): every Python process of a deployment counts
the calls of epdserve's functions and writes the counts when asked.

Active only when ``EPDSERVE_WALK_DIR`` (where the trigger and count files are) and
``EPDSERVE_WALK_PREFIX`` (the directory of the epdserve package, ending in a separator) are
set; otherwise it only hands over to the next ``sitecustomize`` on the path, if any.

* Counting: a ``sys.setprofile`` hook in the main thread and ``threading.setprofile`` for
  every thread started later count each "call" event (a function's call, or a generator's
  or coroutine's resumption) of a code object whose file starts with the prefix; other
  events and other files return at once.
* Writing: a daemon thread polls for ``<dir>/snap-<k>`` (k = 0, 1, ...) and, once it
  appears, writes ``<dir>/<pid>-<k>.json``: ``{"argv": ..., "counts": {"FILE\\tQUALNAME\\tLINE":
  calls}}`` (written to a temporary name, then renamed).
* Order (only in a process whose argv holds the word in ``EPDSERVE_WALK_ORDER``): the
  snapshot also has ``"order": [[context, "FILE\\tQUALNAME\\tLINE"], ...]``, each function's
  first call in each context since the last snapshot, in call order; a context is the
  running asyncio task's name, else the thread's name.
"""

import os
import sys


def _install(directory: str, prefix: str, ordered: bool) -> None:
    import threading

    counts: dict[int, int] = {}   # id(code) -> calls
    codes: dict[int, object] = {}  # id(code) -> code, kept alive so that its id stays its own
    order: list = [[], set()]  # [(context, id(code)) first calls, their set]; swapped by the writer
    if ordered:
        import asyncio

    def context() -> str:
        loop = asyncio._get_running_loop()
        task = asyncio.current_task(loop) if loop is not None else None
        return task.get_name() if task is not None else threading.current_thread().name

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        key = id(code)
        n = counts.get(key)
        if n is None:
            if not code.co_filename.startswith(prefix):
                return
            codes[key] = code
            n = 0
        counts[key] = n + 1
        if ordered:
            seen = (context(), key)
            if seen not in order[1]:
                order[1].add(seen)
                order[0].append(seen)

    # The writer starts before the hooks, so its own polling is never profiled.
    threading.Thread(target=_writer, args=(directory, counts, codes, order), name="walk-writer", daemon=True).start()
    sys.setprofile(profile)
    threading.setprofile(profile)


def _writer(directory: str, counts: dict, codes: dict, order: list) -> None:
    import json
    import time

    k = 0
    while True:
        if not os.path.exists(os.path.join(directory, f"snap-{k}")):
            time.sleep(0.05)
            continue
        now = dict(counts)  # one C-level copy: atomic under the GIL
        firsts, order[:] = order[0], [[], set()]
        known = dict(codes)
        name = {key: f"{c.co_filename}\t{c.co_qualname}\t{c.co_firstlineno}" for key, c in known.items()}
        table = {name[key]: n for key, n in now.items() if key in name}
        path = os.path.join(directory, f"{os.getpid()}-{k}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.orig_argv, "counts": table,
                       "order": [[ctx, name[key]] for ctx, key in firsts if key in name]}, f)
        os.replace(path + ".tmp", path)
        k += 1


def _chain() -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` (the one this one shadows), if any,
    and leave this module registered under the name."""
    import importlib

    here = os.path.dirname(os.path.abspath(__file__))
    this = sys.modules.get(__name__)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.modules.pop(__name__, None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            print(f"walk sitecustomize: the next sitecustomize failed: {e!r}", file=sys.stderr)
    except Exception as e:  # never stop the process that imports this
        print(f"walk sitecustomize: the next sitecustomize failed: {e!r}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if this is not None:
            sys.modules[__name__] = this


_chain()
if os.environ.get("EPDSERVE_WALK_DIR") and os.environ.get("EPDSERVE_WALK_PREFIX"):
    _install(os.environ["EPDSERVE_WALK_DIR"], os.environ["EPDSERVE_WALK_PREFIX"],
             os.environ.get("EPDSERVE_WALK_ORDER", "\0") in sys.orig_argv)
