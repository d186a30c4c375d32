"""Open-loop replay of the elastic policy on the signal samples a router's ``--trace-file``
recorded, with another :class:`PolicyConfig`: what it would have decided on the same signals
(docs/elastic.md, "Replay"); changes by hand restart the dwell as recorded."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from epdserve.serving.elastic.policy import Decision, PolicyConfig, PolicyState, Sample, decide, window
from epdserve.serving.elastic.samples import finite_number


_PARSERS: dict[str, Callable[[dict], object]] = {
    "elastic_sample": lambda obj: Sample.from_json(obj.get("sample")),
    "elastic_dwell": lambda obj: finite_number("elastic_dwell t", obj.get("t"), minimum=-math.inf),
    "elastic_decision": lambda obj: obj.get("roles") is not None,  # a role change, not a scale decision
}


def read_trace(trace_file: str | Path) -> tuple[list[Sample], list[float], int]:
    """(samples, dwell restarts in the controller's s, role changes the controller decided), in
    file order; other lines are ignored.

    Raises OSError, or ValueError naming file:line for bad JSON or a malformed event."""
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
    return read_trace(trace_file)[0]


def read_dwell_restarts(trace_file: str | Path) -> list[float]:
    return read_trace(trace_file)[1]


def replay(samples: list[Sample], config: PolicyConfig, dwell_restarts: Sequence[float] = ()) -> list[Decision]:
    """One decision per sample over the window up to it, the policy state carried as the
    controller carries it; a restart at ``t`` resets the state before the next later sample.

    Raises ValueError for samples whose ``t`` goes backwards."""
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
