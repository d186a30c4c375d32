"""Replay of the elastic policy on a recorded router trace.

tests/data/elastic/shift_2workers.jsonl is a router trace in the contract's format, written
by ``python tests/test_elastic_policy.py`` from its workload models: 2 workers through a
prefill-heavy, a decode-heavy, a prefill-heavy and a quiet minute, with the ``role`` events,
the ``elastic_sample`` line of every sample, the ``elastic_decision`` line of every change
and a request record.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from epdserve.plan.elastic_replay import read_samples, replay
from epdserve.serving.elastic.policy import PolicyConfig, PolicyState, decide

pytestmark = pytest.mark.elastic

RECORDED = Path(__file__).parent / "data" / "elastic" / "shift_2workers.jsonl"
CFG = PolicyConfig(slo_ttft_ms=2000.0, slo_tpot_ms=150.0)
EPOCH = 1.8e9  # the recording's time.time() at the router's monotonic t = 0


def recorded_lines(event):
    lines = map(json.loads, RECORDED.read_text().splitlines())
    return [o for o in lines if o.get("event") == event]


def test_read_samples_reads_only_the_sample_lines():
    samples = read_samples(RECORDED)
    lines = recorded_lines("elastic_sample")
    assert len(samples) == len(lines) == 120
    assert [s.t for s in samples] == [o["at"] - EPOCH for o in lines]
    assert [s.t for s in samples] == [2.0 * i for i in range(120)]
    assert {w.role for w in samples[0].workers} == {"colocated"}
    # split at 10 s: the next sample has the new roles, switching, the one after settled
    assert samples[6].workers[0].role == "prefill" and samples[6].workers[0].switching
    assert not samples[7].workers[0].switching


def test_replay_reproduces_the_recorded_decisions():
    """The recording's controller ran this policy with CFG: replaying it gives its changes
    back, numbers and all, and holds in between."""
    decisions = replay(read_samples(RECORDED), CFG)
    assert len(decisions) == 120
    changed = [{"at": EPOCH + d.t, "action": d.action, "roles": d.roles, "reason": d.reason,
                "signals": d.signals} for d in decisions if d.roles is not None]
    assert changed == [{k: v for k, v in o.items() if k != "event"}
                       for o in recorded_lines("elastic_decision")]
    assert [c["action"] for c in changed] == ["to-pd", "to-colocated", "to-pd", "to-colocated"]


def test_replay_with_a_longer_dwell():
    """What-if: 90 s of dwell. Open loop, so the samples keep the recorded roles: the split
    at 10 s, then nothing until the interference of the second prefill-heavy minute (the
    decode-heavy and quiet phases find the recording already colocated by then)."""
    decisions = replay(read_samples(RECORDED), replace(CFG, min_dwell_s=90.0))
    assert [(d.t, d.action) for d in decisions if d.roles] == [(10.0, "to-pd"), (130.0, "to-pd")]
    between = decisions[7:38]  # 14-74 s: after the recorded switch, before the next one
    assert [d.reason for d in between] == [
        f"{d.t - 10.0:.1f} s since the last change < min dwell 90 s" for d in between]
    assert decisions[6].reason == decisions[38].reason == "w0, w1 still switching"


def test_replay_windows_are_the_last_window_s():
    """With no arrival count to reach, a window is the last window_s seconds."""
    samples = read_samples(RECORDED)
    config = replace(CFG, window_s=6.0, min_dwell_s=10.0, window_arrivals=0)
    state, expected = PolicyState(), []
    for s in samples:
        decision, state = decide([x for x in samples if s.t - 6.0 < x.t <= s.t], state, config)
        expected.append(decision)
    assert replay(samples, config) == expected
    assert replay([], config) == []


def test_replay_refuses_time_going_backwards():
    samples = read_samples(RECORDED)[:3]
    with pytest.raises(ValueError, match=r"sample 2: t 0.0 is before the previous sample's 2.0"):
        replay([samples[0], samples[1], samples[0]], CFG)


def test_read_samples_names_the_bad_line(tmp_path):
    good = RECORDED.read_text().splitlines()[2]
    bad = json.loads(good)
    bad["sample"]["workers"][1]["role"] = "encode"
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([good, "", json.dumps(bad)]) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:3: worker w1: role 'encode' is not one of"):
        read_samples(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"{path}:2: Expecting property name"):
        read_samples(path)
    path.write_text('{"event": "elastic_sample", "at": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: sample: expected a JSON object, got None"):
        read_samples(path)


def test_plan_elastic_replay_command():
    """``epdserve plan elastic-replay`` prints the replayed changes of a recorded trace; without
    the file, or on a trace without samples, exit 2 with a message."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "epdserve", "plan", "elastic-replay", "--slo", "ttft:2000", "tpot:150"]
    out = subprocess.run([*cmd, "--elastic-trace", str(RECORDED)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[3] for line in lines[:-1]] == ["to-pd:", "to-colocated:", "to-pd:", "to-colocated:"]
    assert lines[-1].startswith("4 role changes replayed") and "the recording made 4" in lines[-1]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--elastic-trace FILE is required" in missing.stderr
