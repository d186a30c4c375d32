"""Replay of the elastic controller's policy on recorded signal samples.

The router's controller writes every signal sample it takes to its ``--trace-file`` as an
``{"event": "elastic_sample", "at": UNIX_S, "sample": {...}}`` line
(:meth:`epdserve.serving.elastic.policy.Sample.as_json`). :func:`read_trace` reads them
back and :func:`replay` runs :func:`epdserve.serving.elastic.policy.decide` over them as
the controller would have with another :class:`PolicyConfig` (other SLOs, thresholds,
window or dwell): what it would have decided, and why. The changes the policy did not
decide, a switch by hand (``POST /roles``) or a worker added or retired, are taken as
recorded: each restarted the controller's dwell, written as an ``{"event":
"elastic_dwell", "t": S}`` line (:func:`read_trace`), and restarts the replay's.

The replay is open loop: the recorded samples keep the roles and the signals the recording
had, whatever the replayed decisions say (a what-if on the signals, not a simulation of
the deployment's response: for that, ``epdserve plan --configs elastic`` runs the policy
in the loop of the simulator, :mod:`epdserve.plan.sim_elastic`).
``epdserve plan elastic-replay --elastic-trace FILE`` runs it from the command line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from epdserve.serving.elastic.policy import Decision, PolicyConfig, PolicyState, Sample, decide, window
from epdserve.serving.elastic.samples import finite_number


# What each event line of a router trace holds for a replay (module doc).
_PARSERS: dict[str, Callable[[dict], object]] = {
    "elastic_sample": lambda obj: Sample.from_json(obj.get("sample")),
    "elastic_dwell": lambda obj: finite_number("elastic_dwell t", obj.get("t"), minimum=-math.inf),
    "elastic_decision": lambda obj: obj.get("roles") is not None,  # a role change, not a scale decision
}


def read_trace(trace_file: str | Path) -> tuple[list[Sample], list[float], int]:
    """What a router trace file holds for a replay, in one pass, in file order: the samples
    of its ``elastic_sample`` lines, the times (the controller's clock, s, as the samples'
    ``t``) of its ``elastic_dwell`` lines (the changes the policy did not decide, each of
    which restarted its dwell), and how many role changes its controller decided
    (``elastic_decision`` lines with ``roles``: a worker added or retired has none). Other
    lines (request records, other events, blank lines) are ignored.

    Raises:
        OSError: the file cannot be read.
        ValueError: naming the file and line, for a line that is not JSON or one of these
            events that is malformed.
    """
    found: dict[str, list] = {event: [] for event in _PARSERS}
    for number, line in enumerate(Path(trace_file).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            event = obj.get("event") if isinstance(obj, dict) else None
            if isinstance(event, str) and event in found:
                found[event].append(_PARSERS[event](obj))
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{trace_file}:{number}: {e}") from None
    return found["elastic_sample"], found["elastic_dwell"], sum(found["elastic_decision"])


def read_samples(trace_file: str | Path) -> list[Sample]:
    """The samples of :func:`read_trace`."""
    return read_trace(trace_file)[0]


def read_dwell_restarts(trace_file: str | Path) -> list[float]:
    """The dwell restarts (s) of :func:`read_trace`."""
    return read_trace(trace_file)[1]


def replay(samples: list[Sample], config: PolicyConfig, dwell_restarts: Sequence[float] = ()) -> list[Decision]:
    """One decision per sample: sample i is "now", its window the samples
    :func:`~epdserve.serving.elastic.policy.window` keeps of those up to it, and the
    policy's state carried from decision to decision (from :class:`PolicyState`'s start),
    as the router's controller calls :func:`decide` every interval. A restart at ``t``
    (``dwell_restarts``, s) restarts the state from ``t`` before the first decision on a
    later sample, as the controller did.

    Raises:
        ValueError: for samples whose ``t`` goes backwards (naming the index).
    """
    decisions, state = [], PolicyState()
    restarts = sorted(dwell_restarts)
    for i, now in enumerate(samples):
        if i and now.t < samples[i - 1].t:
            raise ValueError(f"sample {i}: t {now.t} is before the previous sample's "
                             f"{samples[i - 1].t} (samples must be in time order)")
        while restarts and restarts[0] < now.t:
            state = PolicyState(last_switch_t=restarts.pop(0))
        decision, state = decide(window(samples[:i + 1], config), state, config)
        decisions.append(decision)
    return decisions
