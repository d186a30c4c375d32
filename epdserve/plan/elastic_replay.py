"""Replay of the elastic controller's policy on recorded signal samples (issue 20).

The router's controller writes every signal sample it takes to its ``--trace-file`` as an
``{"event": "elastic_sample", "at": UNIX_S, "sample": {...}}`` line
(:meth:`epdserve.serving.elastic_policy.Sample.as_json`). :func:`read_samples` reads them
back and :func:`replay` runs :func:`epdserve.serving.elastic_policy.decide` over them as
the controller would have with another :class:`PolicyConfig` (other SLOs, thresholds,
window or dwell): what it would have decided, and why.

The replay is open loop: the recorded samples keep the roles and the signals the recording
had, whatever the replayed decisions say (a what-if on the signals, not a simulation of
the deployment's response: for that, ``epdserve plan --configs elastic`` runs the policy
in the loop of the simulator, :mod:`epdserve.plan.sim_elastic`).
``epdserve plan elastic-replay --elastic-trace FILE`` runs it from the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

from epdserve.serving.elastic_policy import Decision, PolicyConfig, PolicyState, Sample, decide, window


def read_samples(trace_file: str | Path) -> list[Sample]:
    """The samples of a router trace file's ``elastic_sample`` lines, in file order; other
    lines (request records, ``role`` and ``elastic_decision`` events, blank lines) are
    ignored.

    Raises:
        OSError: the file cannot be read.
        ValueError: naming the file and line, for a line that is not JSON or an
            ``elastic_sample`` line whose ``sample`` is malformed.
    """
    samples = []
    for number, line in enumerate(Path(trace_file).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("event") == "elastic_sample":
                samples.append(Sample.from_json(obj.get("sample")))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{trace_file}:{number}: {e}") from None
    return samples


def replay(samples: list[Sample], config: PolicyConfig) -> list[Decision]:
    """One decision per sample: sample i is "now", its window the samples
    :func:`~epdserve.serving.elastic_policy.window` keeps of those up to it, and the
    policy's state carried from decision to decision (from :class:`PolicyState`'s start),
    as the router's controller calls :func:`decide` every interval.

    Raises:
        ValueError: for samples whose ``t`` goes backwards (naming the index).
    """
    decisions, state = [], PolicyState()
    for i, now in enumerate(samples):
        if i and now.t < samples[i - 1].t:
            raise ValueError(f"sample {i}: t {now.t} is before the previous sample's "
                             f"{samples[i - 1].t} (samples must be in time order)")
        decision, state = decide(window(samples[:i + 1], config), state, config)
        decisions.append(decision)
    return decisions
