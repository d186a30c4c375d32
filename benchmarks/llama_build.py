"""Build llama.cpp's ``llama-server`` from the sources vendored in the ``llama-cpp-python``
sdist from PyPI, once, into ``~/.cache/epdserve/llama.cpp-VERSION/build/bin/llama-server``
(CPU only, nothing fetched during the build but the sdist). Used by ``benchmarks/speed.py``
and by the tests that run ``llama-server`` (``tests/test_bench_deployments.py``, which load
this file by path).

    .venv/bin/python benchmarks/llama_build.py     # prints the binary's path

Concurrent builds into the same cache wait for each other (a lock file next to the build).
"""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from epdserve.bench.processes import log_tail
from epdserve.model.kernels import cpu_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"


class BuildError(RuntimeError):
    """llama-server could not be built; the message has the command and the log tail."""


def runtime_flags() -> list[str]:
    """The llama-server flags this CPU needs: ``--no-repack`` where it has AMX. The
    ``GGML_NATIVE`` build then holds the Q4_1 weights in ggml's AMX buffers, and
    ``ggml_backend_amx_mul_mat`` crashes (SIGSEGV) on the first batch (llama.cpp of
    llama-cpp-python 0.3.36; seen on a Xeon with AMX-INT8/BF16). Without repacking the
    weights stay in the plain CPU buffers."""
    return ["--no-repack"] if any(f.startswith("amx") for f in cpu_flags()) else []


def default_cache_dir(version: str) -> Path:
    """Where the sources, the build and its log go: ~/.cache/epdserve/llama.cpp-VERSION."""
    return Path.home() / ".cache" / "epdserve" / f"llama.cpp-{version}"


def _run_logged(cmd: list[str], log_path: Path, cwd: Path | None = None,
                progress: re.Pattern | None = None) -> None:
    """Run ``cmd``, appending its output to ``log_path``; print each ``progress`` match
    that reaches a new tenth of the total (ninja/make "[k/N]" lines).

    Raises:
        BuildError: ``cmd`` exited non-zero (message: the command and the log tail).
    """
    print(f"  $ {' '.join(cmd)}", flush=True)
    shown = -1
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
        for line in proc.stdout:
            log.write(line)
            m = progress.search(line) if progress else None
            if m:
                k, n = int(m[1]), int(m[2])
                if k * 10 // n > shown or k == n:
                    shown = k * 10 // n
                    print(f"  [{k}/{n}] {line.strip()[-90:]}", flush=True)
        rc = proc.wait()
    if rc != 0:
        raise BuildError(f"command failed with status {rc}: {' '.join(cmd)}\n"
                         f"last lines of {log_path}:\n{log_tail(log_path, 30)}")


def _fetch_sdist(version: str, cache_dir: Path, sdist: Path | None) -> Path:
    """The llama-cpp-python sdist: ``sdist`` if given, else the one in ``cache_dir``, else
    ``pip download``-ed from PyPI into ``cache_dir`` (source only, no dependencies)."""
    if sdist is not None:
        if not sdist.is_file():
            raise BuildError(f"--sdist {sdist}: no such file")
        return sdist
    found = sorted(cache_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    print(f"[build] downloading llama-cpp-python=={version} sdist from PyPI", flush=True)
    _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={version}", "-d", str(cache_dir)], cache_dir / "build.log")
    found = sorted(cache_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise BuildError(f"pip download left no llama_cpp_python-{version}.tar.gz in {cache_dir}")
    return found[0]


def _unpack_llama_cpp(sdist: Path, dest: Path) -> None:
    """Extract the sdist's ``vendor/llama.cpp`` tree into ``dest``."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise BuildError(f"{sdist}: no {prefix} inside (not a llama-cpp-python sdist?)")
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    tmp.rename(dest)


def build_llama_server(version: str, cache_dir: Path, sdist: Path | None = None,
                       jobs: int = 2) -> Path:
    """Path of a ``llama-server`` binary built from the llama.cpp sources vendored in the
    ``llama-cpp-python`` ``version`` sdist; built once into ``cache_dir/build`` (CPU only,
    Release, ``GGML_NATIVE``, static, no OpenSSL, no web UI download: nothing fetched from
    the network during the build), reused when it exists. Build output goes to
    ``cache_dir/build.log``.

    Raises:
        BuildError: cmake or a C/C++ compiler is missing, the sdist cannot be had, or a
            build step failed (the message has the command and the log tail).
    """
    binary = cache_dir / "build" / "bin" / "llama-server"
    if binary.is_file():
        print(f"[build] using cached {binary}", flush=True)
        return binary
    missing = [name for name, tools in (("cmake", ("cmake",)),
                                        ("a C++ compiler", ("c++", "g++", "clang++")))
               if not any(shutil.which(t) for t in tools)]
    if missing:
        raise BuildError(f"building llama-server needs {' and '.join(missing)} on PATH "
                         f"(e.g. apt-get install cmake g++); or pass --llama-server PATH to "
                         f"use a built binary, or leave llama-server out of --engines")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build into this cache: wait for it
        if not binary.is_file():
            _build(version, cache_dir, sdist, jobs)
    if not binary.is_file():
        raise BuildError(f"the build finished but {binary} is missing; see "
                         f"{cache_dir / 'build.log'}")
    print(f"[build] done: {binary}", flush=True)
    return binary


def _build(version: str, cache_dir: Path, sdist: Path | None, jobs: int) -> None:
    """Unpack the sources (once) and configure and build llama-server into
    ``cache_dir/build`` (raises BuildError: :func:`build_llama_server`)."""
    src = cache_dir / "src"
    if not (src / "CMakeLists.txt").is_file():
        archive = _fetch_sdist(version, cache_dir, sdist)
        print(f"[build] unpacking vendor/llama.cpp from {archive} into {src}", flush=True)
        _unpack_llama_cpp(archive, src)
    log = cache_dir / "build.log"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"[build] configuring (log: {log})", flush=True)
    _run_logged(["cmake", "-S", str(src), "-B", str(cache_dir / "build"), *generator,
                 "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], log)
    print(f"[build] compiling llama-server with {jobs} jobs (minutes on 2 cores)", flush=True)
    _run_logged(["cmake", "--build", str(cache_dir / "build"), "--target", "llama-server",
                 "-j", str(jobs)], log, progress=re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\]"))


if __name__ == "__main__":
    try:
        print(build_llama_server(LLAMA_CPP_PYTHON_VERSION,
                                 default_cache_dir(LLAMA_CPP_PYTHON_VERSION)))
    except BuildError as exc:
        print(f"llama_build: error: {exc}", file=sys.stderr)
        sys.exit(1)
