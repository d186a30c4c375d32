"""The tokens a step computes when the operator sets none (model/step_budget.py): the rule
from a prefill speed, the measured value an engine on the CPU schedules with and reports,
and the planner's workers, which take the same rule from their step models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.scheduler import SchedulerConfig
from epdserve.model import step_budget, tuning
from epdserve.model.base import cache_root
from epdserve.plan import simulate
from epdserve.plan.costmodel import LinearStep, Link, Platform
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec


@pytest.mark.parametrize("tokens_per_s, budget", [
    (100, 256),      # a slow machine: never under the smallest
    (700, 256),      # 350 tokens in half a second: nearer 256 than 512
    (1000, 512),     # this 2-core Xeon in float32 (~950 prompt tokens/s)
    (2800, 1024),    # 1,400: nearer 1,024 than 2,048 (by the logarithm)
    (3000, 2048),
    (1e6, 2048),     # a GPU: never over vLLM's CPU default
])
def test_the_budget_is_half_a_second_of_prefill_to_a_power_of_two(tokens_per_s, budget):
    assert step_budget.from_rate(tokens_per_s) == budget
    assert step_budget.valid(budget)


def test_only_what_the_rule_gives_is_a_valid_kept_value():
    assert not any(step_budget.valid(v) for v in (128, 384, 4096, "512", 512.0, None))


def test_an_engine_on_the_cpu_schedules_with_its_measured_budget(model_info):
    engine = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=32, weight_format="f32"))
    tuned = engine.tuned["max_num_batched_tokens"]
    assert step_budget.valid(tuned.value) and tuned.path.parent == cache_root() / "tuning" / "max_num_batched_tokens"
    assert engine.scheduler.config.max_num_batched_tokens == tuned.value
    again = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=32, weight_format="f32"))
    if tuned.source != tuning.DISTURBED:  # a clean measurement is read back, not taken again
        assert again.tuned["max_num_batched_tokens"] == tuning.Tuned(tuned.value, tuning.CACHE, tuned.path)


def test_a_set_budget_or_an_unchunked_engine_measures_nothing(model_info):
    config = EngineConfig(kv_cache_memory_mb=32, weight_format="f32")
    fixed = LLMEngine(str(model_info.path), replace(config, max_num_batched_tokens=300))
    whole = LLMEngine(str(model_info.path), replace(config, enable_chunked_prefill=False))
    assert fixed.scheduler.config.max_num_batched_tokens == 300
    assert whole.scheduler.config.max_num_batched_tokens == whole.max_model_len
    assert "max_num_batched_tokens" not in fixed.tuned | whole.tuned


def _worker(limits: EngineLimits, tp: int = 1):
    """The worker of a one-worker deployment on a platform whose step costs 20 ms + 1 ms per
    new token (a 256-token prompt 276 ms: ~930 tokens/s)."""
    flat = Platform("flat", step=lambda n: LinearStep((20.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1, 2),
                    kv_bytes_per_token=1000, kv_link=Link(gbs=1.0, latency_ms=5.0), price_per_device_hour=1.0)
    deployment = Deployment("colocated", (WorkerSpec("colocated", devices=tp, tp=tp),))
    return simulate.Simulation(deployment, flat, limits).workers[0]


def test_a_simulated_worker_takes_the_engines_rule_from_its_step_model():
    assert _worker(EngineLimits()).budget == step_budget.from_rate(256 / 0.276) == 512
    assert _worker(EngineLimits(max_num_batched_tokens=300)).budget == 300
    assert _worker(EngineLimits(), tp=2).budget == SchedulerConfig.max_num_batched_tokens
