"""The planner's tensor-parallel workers on the CPU: compare's ``-tpP/D`` deployments placed
as serve places them, a calibrated TP fit stepping them, and calibrations without one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from epdserve.bench.workload import Request, save_trace
from epdserve.plan import calibrate, search
from epdserve.plan.costmodel import NoStepModel
from epdserve.plan.serving_fit import compare_runs, fitted_on
from epdserve.plan.simulate import WorkerSpec, simulate
from epdserve.plan.validation import compare_deployment, compare_limits, validate

pytestmark = pytest.mark.plan

ONE_CORE, TWO_CORES, TP2 = (10.0, 0.0, 0.0, 0.0, 0.0), (8.0, 0.0, 0.0, 0.0, 0.0), (30.0, 0.0, 0.0, 0.0, 0.0)


def req(offset_s: float, prompt_tokens: int, max_tokens: int) -> Request:
    return Request(offset_s, "", max_tokens, "chat", prompt_tokens, ())


def calibration(tp: bool = True, contended: float = 1.0) -> dict:
    """Steps of 10 ms on one core, 8 ms on two (one process), 30 ms on a worker of 2 TP
    ranks (``tp``: else a calibration made before those were timed)."""
    cal = {"model": "m", "steps": {"1": {"coef": list(ONE_CORE)}, "2": {"coef": list(TWO_CORES)}},
           "kv_link": {"gbs": 1.0, "latency_ms": 0.5}, "kv_bytes_per_token": 10,
           "serving": {"contended_slowdown": contended}}
    if tp:
        cal["tp_steps"] = {"2": {"coef": list(TP2)}}
    return cal


def test_compare_places_tp_workers_as_serve_does():
    # On 2 cores the prefill worker's 2 ranks take cores 0 and 1, the decode worker core 0 again.
    dep = compare_deployment("1p1d-tp2/1", 2)
    assert dep.workers == (WorkerSpec("prefill", 2, tp=2, overlap="0,1"), WorkerSpec("decode", 1, overlap="0,1"))
    assert dep.devices == 2 and dep.mode == "pd"
    # With a core a rank nothing overlaps: prefill 0,1 (2 ranks), decode 2,3 (one process).
    assert compare_deployment("1p1d-tp2/1", 4).workers == (WorkerSpec("prefill", 2, tp=2), WorkerSpec("decode", 2))
    # Both workers on both cores: they share them whole.
    assert compare_deployment("1p1d-tp2", 2).workers == (WorkerSpec("prefill", 2, "0,1", 2),
                                                         WorkerSpec("decode", 2, "0,1", 2))
    assert compare_deployment("colocated", 2).workers == (WorkerSpec("colocated", 2),)


def test_a_tp_worker_steps_by_its_fit():
    platform = calibrate.platform_from(calibration())
    assert platform.worker_step(2, 2).coef == TP2 and platform.worker_step(2).coef == TWO_CORES
    dep = compare_deployment("1p1d-tp2/1", 2)
    records, traces = simulate(dep, platform, [req(0.0, 5, 3)], compare_limits("1p1d-tp2/1"))
    # router 3 ms, then the prefill step of the TP fit: 30 ms (the decode worker idle).
    assert records[0].chunk_times_s[0] == pytest.approx(0.033)
    assert traces[0].prefill_ms == pytest.approx(30.0)


def test_overlapping_workers_take_the_contended_slowdown():
    # Request 0 decodes (10 ms steps) from ~34 ms to ~530 ms on core 0; request 1's prefill
    # starts at 108 ms, mid-step, on cores 0,1: x2, 60 ms. Without overlap (4 cores): 30 ms.
    platform = calibrate.platform_from(calibration(contended=2.0))
    reqs = [req(0.0, 5, 50), req(0.105, 5, 3)]
    records, _ = simulate(compare_deployment("1p1d-tp2/1", 2), platform, reqs)
    assert records[0].chunk_times_s[0] == pytest.approx(0.033)
    assert records[1].chunk_times_s[0] == pytest.approx(0.063)
    records, _ = simulate(compare_deployment("1p1d-tp2/1", 4), platform, reqs)
    assert records[1].chunk_times_s[0] == pytest.approx(0.033)


def test_a_calibration_without_tp_fits_is_refused(tmp_path):
    platform = calibrate.platform_from(calibrate.load(calibrate.save(calibration(tp=False), tmp_path / "c.json")))
    with pytest.raises(ValueError, match=r"rerun `epdserve plan calibrate`"):
        platform.worker_step(2, 2)
    with pytest.raises(ValueError, match=r"tensor-parallel worker .*rerun `epdserve plan calibrate`"):
        simulate(compare_deployment("1p1d-tp2/1", 2), platform, [req(0.0, 5, 3)])
    with pytest.raises(ValueError, match=r"3 ranks \(have \[2\]\)"):
        calibrate.platform_from(calibration()).worker_step(3, 3)
    with pytest.raises(ValueError, match="vision-language model"):
        calibrate._tp_step({}, True, 2)
    # One-process workers still simulate.
    simulate(compare_deployment("1p1d", 2), platform, [req(0.0, 5, 3)])


def _compare_dir(path: Path, reqs: list[Request]) -> Path:
    path.mkdir()
    save_trace(reqs, path / "trace.jsonl")
    result = {"p95_ttft_ms": 40.0, "p95_itl_ms": 12.0, "output_throughput": 10.0}
    configs = [{"name": name, "result": result, "resources": {"workers": [
        {"worker_id": "prefill-0", "role": "prefill", "cores": cores[0]},
        {"worker_id": "decode-0", "role": "decode", "cores": cores[1]}]}}
        for name, cores in (("1p1d", ([0], [1])), ("1p1d-tp2/1", ([0, 1], [0])))]
    (path / "compare.json").write_text(json.dumps({"configs": configs}))
    return path


def test_validate_predicts_a_tp_configuration_or_says_why_not(tmp_path, capsys):
    run = _compare_dir(tmp_path / "run", [req(0.1 * i, 5, 4) for i in range(4)])
    rows = {r["name"]: r for r in validate([run], calibrate.platform_from(calibration()))[0]}
    assert set(rows) == {"1p1d", "1p1d-tp2/1"}
    assert rows["1p1d-tp2/1"]["p95_ttft_ms"]["predicted"] == pytest.approx(33.0)
    rows, predicted = validate([run], calibrate.platform_from(calibration(tp=False)))
    assert [r["name"] for r in rows] == [e["name"] for e in predicted] == ["1p1d"]
    assert "skipped 1p1d-tp2/1: " in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_times_a_tp2_worker(model_info, monkeypatch, tmp_path):
    """``plan calibrate`` at tiny sizes, the text model only: beside the 1- and 2-core fits,
    a fit of a TP=2 worker (rank 0 here on one core, a follower on the next) that loads."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    monkeypatch.setattr(calibrate, "PREFILL_LENS", (16, 48, 96))
    monkeypatch.setattr(calibrate, "DECODE_BATCHES", (1, 2))
    monkeypatch.setattr(calibrate, "DECODE_CONTEXTS", (32,))
    monkeypatch.setattr(calibrate, "TP_KV_MB", 32)
    monkeypatch.setattr(calibrate, "_vision_dir", lambda info: None)
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cal = calibrate.calibrate(str(model_info.path), reps=1, decode_steps=2, rounds=1, progress=False)
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads
    fit = cal["tp_steps"]["2"]
    assert len(fit["samples"]) == 3 + 2 * 2 * 2 and all(s["ms"] > 0 for s in fit["samples"])
    platform = calibrate.platform_from(calibrate.load(calibrate.save(cal, tmp_path / "cal.json")))
    step = platform.worker_step(2, 2)
    assert step.coef == tuple(fit["coef"]) and step.step_ms([(96, 0)]) > step.step_ms([], 1, 32, 32) > 0


def test_the_serving_fit_leaves_tp_configurations_out():
    assert fitted_on({"name": "1p1d"}) and fitted_on({"name": "colocated-2"})
    assert not fitted_on({"name": "1p1d-tp2/1"}) and not fitted_on({"name": "colocated-tp2"})
    assert not fitted_on({"name": "elastic", "mode": "elastic"})
    assert fitted_on({"name": "a name of another epdserve"})


def test_plan_candidates_name_their_tp_workers_and_are_skipped_without_a_fit():
    platform = calibrate.platform_from(calibration())
    three = {d.name: d for d in search.candidates(platform, 3)}
    # Each -tp name's workers are tensor parallel, as serve runs that name; colocated's one worker is one process.
    assert three["1p1d-tp2/1"].workers == (WorkerSpec("prefill", 2, tp=2), WorkerSpec("decode", 1))
    assert {d.name: d for d in search.candidates(platform, 2)}["colocated"].workers == (WorkerSpec("colocated", 2),)
    assert {d.name: d for d in search.candidates(platform, 4)}["colocated-2-tp2"].workers[0].tp == 2
    reqs = [req(0.0, 5, 3)]
    records, _ = simulate(three["1p1d-tp2/1"], platform, reqs)
    assert records[0].chunk_times_s[0] == pytest.approx(0.033)  # router 3 ms + the TP fit's 30 ms
    with pytest.raises(NoStepModel):
        simulate(three["1p1d-tp2/1"], calibrate.platform_from(calibration(tp=False)), reqs)


def test_a_compare_that_merged_rounds_is_refused_for_a_fit_with_the_reason(tmp_path):
    (tmp_path / "compare.json").write_text(json.dumps({"configs": [{"name": "colocated", "result": {},
                                                                          "resources": {"workers": [{}]}}]}))
    with pytest.raises(ValueError, match=r"colocated merge several rounds \(--repeats\) and keep no per-request "
                                         r"times; fit on `epdserve compare --repeats 1`"):
        compare_runs(tmp_path, None)
