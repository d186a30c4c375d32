"""Measured choices (model/tuning.py) and the block kernel / BLAS cut-over (model/cutover.py):
the cut-over's rule, an entry kept per machine and key, a disturbed measurement measured again
or kept marked disturbed and measured again at the next start, stale entries replaced, a real
disturbance (processes spinning on this process's cores) detected and never kept as final, and
``epdserve tune``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from epdserve.model import cutover, kernels, tuning
from epdserve.model.base import cache_root

SPIN = ("import os, time\nos.sched_setaffinity(0, {%d})\nprint('spinning', flush=True)\n"
        "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n")


def test_the_cutover_is_where_the_blas_stays_faster():
    assert cutover.kernel_rows_for({1: (1, 2), 8: (2, 3), 32: (5, 4), 64: (9, 6)}) == 8
    assert cutover.kernel_rows_for({1: (1, 2), 8: (4, 3), 32: (5, 6), 64: (9, 6)}) == 32  # not yet at 8
    assert cutover.kernel_rows_for({1: (1, 2), 64: (5, 6)}) == 64  # the kernel throughout
    assert cutover.kernel_rows_for({1: (3, 2), 64: (9, 6)}) == 0  # the BLAS throughout


def times(overtake: int, noisy: bool = False) -> dict[str, list[float]]:
    """Three rounds of cut-over times in which the BLAS overtakes the kernel at ``overtake``
    rows; ``noisy``: one slow round of the BLAS at 16 and more rows makes the medians put the
    cut-over elsewhere than the bests do."""
    out = {}
    for m in cutover.ROWS:
        kernel, blas = m * 1e-5, (overtake + m) * 0.5e-5
        out[cutover.candidate("kernel", m)] = [kernel] * 3
        slow = blas * (3 if noisy and m >= 16 else 1)
        out[cutover.candidate("blas", m)] = [blas, slow, slow]
    return out


class Measurements:
    """A fake ``measure`` returning the given attempts in turn, counting the calls."""

    def __init__(self, *attempts: tuning.Attempt):
        self.attempts, self.calls = list(attempts), 0

    def __call__(self) -> tuning.Attempt:
        self.calls += 1
        return self.attempts[min(self.calls, len(self.attempts)) - 1]


CLEAN = tuning.Attempt(times(20), 0.01, 0.0)  # the BLAS faster from 24 rows: 16 on the kernel
NOISY = tuning.Attempt(times(20, noisy=True), 0.01, 0.0)
LOADED = tuning.Attempt(times(20), 0.4, 0.0)  # others took 40 % of the cores


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_CACHE", str(tmp_path))
    return tmp_path


def kept(cache) -> list[dict]:
    return [json.loads(f.read_text()) for f in (cache / "tuning" / "cutover").glob("*.json")]


def test_a_clean_measurement_is_kept_per_machine_and_key(cache):
    assert cutover.decide(NOISY.median()) != cutover.decide(NOISY.best()) == 16
    m = Measurements(CLEAN)
    first = tuning.choose("cutover", ["layer A"], m, cutover.decide, cutover.valid)
    assert (first.value, first.source, m.calls) == (16, tuning.MEASURED, 1)
    again = tuning.choose("cutover", ["layer A"], m, cutover.decide, cutover.valid)
    assert (again.value, again.source, m.calls) == (16, tuning.CACHE, 1)
    other = tuning.choose("cutover", ["layer B"], m, cutover.decide, cutover.valid)
    assert other.source == tuning.MEASURED and m.calls == 2
    entries = kept(cache)
    assert sorted(e["key"][0] for e in entries) == ["layer A", "layer B"]
    e = entries[0]
    assert e["value"] == 16 and e["disturbed"] is False and e["machine"] == tuning.machine()
    assert set(e["best_ms"]) == set(e["median_ms"]) == set(CLEAN.times) and e["outside_share"] == 0.01


@pytest.mark.parametrize("disturbed", [NOISY, LOADED], ids=["repeats-disagree", "outside-load"])
def test_a_disturbed_measurement_is_measured_again(cache, disturbed):
    m = Measurements(disturbed, CLEAN)
    got = tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid)
    assert (got.value, got.source, m.calls) == (16, tuning.MEASURED, 2)
    assert kept(cache)[0]["attempts"] == 2


def test_a_choice_from_disturbed_measurements_is_kept_marked_and_measured_again(cache):
    m = Measurements(LOADED, NOISY)
    got = tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid)
    assert (got.value, got.source, m.calls) == (16, tuning.DISTURBED, tuning.ATTEMPTS)
    assert got.as_json() == {"value": 16, "source": "disturbed"}
    entry = kept(cache)[0]
    assert entry["disturbed"] is True and entry["attempts"] == tuning.ATTEMPTS and entry["value"] == 16
    # The next start, still busy: one attempt more, pooled with the kept best times.
    again = tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid)
    assert (again.source, m.calls, kept(cache)[0]["attempts"]) == (tuning.DISTURBED, tuning.ATTEMPTS + 1,
                                                                   tuning.ATTEMPTS + 1)
    m.attempts = [CLEAN]  # a start on a quiet machine replaces it
    assert tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid).source == tuning.MEASURED
    assert kept(cache)[0]["disturbed"] is False
    assert tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid).source == tuning.CACHE


def test_a_later_start_pools_its_best_times_with_the_kept_ones(cache):
    """Each candidate's best over every disturbed attempt decides: a candidate slowed in one
    attempt is judged by its time in another."""
    slow_blas = {c: [t * (5 if c.startswith("blas") else 1) for t in ts] for c, ts in times(20).items()}
    first = tuning.choose("cutover", ["layer"], Measurements(tuning.Attempt(slow_blas, 0.5, 0.0)), cutover.decide,
                          cutover.valid)
    assert first.value == max(cutover.ROWS)  # the BLAS looked slow everywhere
    slow_kernel = {c: [t * (5 if c.startswith("kernel") else 1) for t in ts] for c, ts in times(20).items()}
    second = tuning.choose("cutover", ["layer"], Measurements(tuning.Attempt(slow_kernel, 0.5, 0.0)),
                           cutover.decide, cutover.valid)
    assert (second.value, second.source) == (16, tuning.DISTURBED)  # each way at its best: as a quiet run


def test_stale_entries_are_replaced_and_force_measures_again(cache):
    m = Measurements(CLEAN)
    path = tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid).path
    entry = json.loads(path.read_text())
    for stale in ({**entry, "version": tuning.VERSION - 1}, {**entry, "disturbed": True}, "not json {", "[]",
                  {**entry, "value": "abc"}, {**entry, "value": -7}, {**entry, "value": 17},
                  {**entry, "best_ms": {"kernel@1": "fast"}}):
        path.write_text(stale if isinstance(stale, str) else json.dumps(stale))
        before = m.calls
        assert tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid).source == tuning.MEASURED
        assert m.calls == before + 1 and json.loads(path.read_text()) != stale
    before = m.calls
    assert tuning.choose("cutover", ["layer"], m, cutover.decide, cutover.valid, force=True).source == tuning.MEASURED
    assert m.calls == before + 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc/stat")
def test_processes_spinning_on_our_cores_are_seen_and_their_choice_is_not_kept(cache):
    """Real load: one spinning process per core of this process while a real cut-over-like
    choice (matmuls of 1-256 rows) is timed: the attempt sees the outside load, every attempt
    is disturbed, the entry is kept marked disturbed."""
    # Matmuls long enough (~0.3 s an attempt) for /proc/stat's 10 ms ticks to count the load.
    a, b = torch.randn(256, 2048), torch.randn(2048, 2048)
    candidates = {cutover.candidate(w, m): (lambda m=m: a[:m] @ b) for m in cutover.ROWS for w in cutover.WAYS}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN % core], stdout=subprocess.PIPE, text=True)
                for core in sorted(os.sched_getaffinity(0))]
    try:
        for p in spinners:  # each is spinning before anything is timed
            assert p.stdout.readline().strip() == "spinning"
        got = tuning.choose("cutover", ["spun"], lambda: tuning.time_rounds(candidates), cutover.decide,
                            cutover.valid)
        loaded = tuning.time_rounds(candidates)
    finally:
        for p in spinners:
            p.kill()
            p.wait(timeout=10)
    assert loaded.outside_share >= tuning.host.OUTSIDE_SHARE_WARN and loaded.loaded()
    assert got.source == tuning.DISTURBED and [e["disturbed"] for e in kept(cache)] == [True]
    quiet = tuning.time_rounds(candidates)  # the spinners gone
    assert quiet.outside_share < loaded.outside_share


def run_tune(*args: str, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "EPDSERVE_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "epdserve", "tune", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_tune_refuses_a_thread_count_it_cannot_run(tmp_path):
    got = run_tune("--threads", "999", cache=tmp_path)
    assert got.returncode == 2 and "--threads 999: between 1 and the" in got.stderr
    got = run_tune("--weight-formats", "q5_0", cache=tmp_path)
    assert got.returncode == 2 and "invalid choice: 'q5_0'" in got.stderr


@pytest.mark.skipif(not kernels.cpu_supported(), reason="the GGUF block kernels need AVX2 and FMA")
def test_tune_measures_again_and_keeps_it(tmp_path):
    """``epdserve tune`` on the real model: a line per thread count and format with the CPU
    model, the entry kept where a worker reads it (that it measures again rather than read
    the cache: ``force``, above)."""
    threads = str(len(os.sched_getaffinity(0)))
    assert kernels.available()  # built once, in the real cache, and lent to the temporary one (~40 s a build)
    (tmp_path / "torch_extensions").symlink_to(cache_root() / "torch_extensions", target_is_directory=True)
    first = run_tune("--threads", threads, "--weight-formats", "q4_1", cache=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0].startswith(kernels.cpu_model())
    assert "q4_1" in first.stdout and "kernel_rows" in first.stdout and "(measured;" in first.stdout
    assert "max_num_batched_tokens" in first.stdout  # the step budget, measured again too
    assert len(list((tmp_path / "tuning" / "max_num_batched_tokens").glob("*.json"))) == 1
    entries = kept(tmp_path)
    assert len(entries) == 1 and entries[0]["machine"]["threads"] == int(threads)
