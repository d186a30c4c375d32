"""Each flag that several commands take is declared once: one default and one help text
wherever it appears (serve's pass-through of a worker flag is the worker's declaration:
default None, "not given", with the worker's default named in its help). A flag name that
means a different thing in different commands is listed in OTHER_MEANING with the reason."""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict

from epdserve.cli import COMMANDS

OTHER_MEANING = {
    "--model": "serve, worker, router and compare load it (a path or tag); plan reads a model profile; bench "
               "sends it as the request's model name, as `vllm bench serve --model` does",
    "--output": "each command's own results folder",
    "--port": "serve and router listen on it; compare starts its servers on it (8100, so that a server the "
              "user runs on serve's 8000 stays untouched)",
    "--request-timeout": "the router's wait for a worker's output; bench's and compare's wait for the server's",
    "--startup-timeout": "serve waits for its workers' hellos; compare for a whole deployment's /health",
    "--slo": "serve and router: the elastic controller's SLOs (ttft, tpot); plan: the goodput SLOs, as "
             "compare's --goodput",
    "--sweep-rates": "bench's bracket of its sweep; compare sweeps only when it is given",
    "--sweep-iters": "compare sweeps every configuration of every round: one step fewer than bench",
    "--trace": "plan also reads production traces (Mooncake, Azure) directly",
    "--workload": "compare's default is the demo workload (long-prompt bursts, where splitting shows); "
                  "bench's vLLM's synthetic random lengths",
    "--dataset-name": "vLLM's name for --workload",
    "--goodput": "report judges a saved run again by it; without it, by the SLOs that run was judged by (bench "
                 "and compare: the default SLOs)",
}


def _declarations() -> dict[str, list[tuple[str, argparse.Action]]]:
    """Every long option of every command (sub-commands included), with its action."""
    seen = defaultdict(list)

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    seen[option].append((path, action))

    for command, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=command)
        importlib.import_module(module).add_arguments(parser)
        walk(parser, command)
    return seen


def _declared(action: argparse.Action) -> tuple:
    """(default, help, type, choices) as declared: a Flag's own, whatever serve's
    pass-through made of it. A type is compared by name (a bound such as float_above(0) is
    a new function at each call)."""
    flag = getattr(action, "flag", None)
    kw = flag.kwargs if flag is not None else vars(action)
    kind = kw.get("type")
    return kw.get("default"), kw.get("help"), getattr(kind, "__qualname__", kind), kw.get("choices")


def test_each_shared_flag_has_one_default_and_one_help():
    clashes = []
    for option, uses in sorted(_declarations().items()):
        if len(uses) < 2 or option in OTHER_MEANING:
            continue
        declared = {repr(_declared(action)) for _, action in uses}
        if len(declared) > 1:
            clashes.append(f"{option}: " + "; ".join(f"{path}: default {_declared(a)[0]!r}, help "
                                                     f"{(_declared(a)[1] or '')[:60]!r}" for path, a in uses))
    assert not clashes, "\n".join(clashes)


def test_serve_passes_worker_flags_with_the_workers_declaration():
    uses = _declarations()
    serve = {path: action for path, action in uses["--kv-cache-memory-mb"]}
    assert serve["serve"].default is None and serve["worker"].default == 1024
    assert serve["serve"].help.endswith("passed to each worker (default: 1024)")
    assert _declared(serve["serve"]) == _declared(serve["worker"])  # the same field


def test_role_tensor_parallel_flags_are_serves_alone_and_declared_once():
    from epdserve.serving import flags

    uses = _declarations()
    for flag in flags.ROLE_TP_FLAGS:
        assert [(path, action.flag.kwargs) for path, action in uses[flag.name]] == [("serve", flag.kwargs)]
        assert flag.kwargs["default"] is None  # not given: --tensor-parallel-size's value (encode: 1)
    assert [f.name for f in flags.ROLE_TP_FLAGS] == ["--prefill-tp", "--decode-tp", "--encode-tp"]


def test_other_meanings_are_still_shared_names():
    uses = _declarations()
    stale = [option for option in OTHER_MEANING if len(uses.get(option, [])) < 2]
    assert not stale, f"no longer in two commands, remove from OTHER_MEANING: {stale}"


def test_every_worker_and_router_flag_is_its_config_field():
    """A flag parsed and left out of the config would be accepted and ignored: the worker's
    and the router's flags are their configs' fields, declared there once, and every one
    reaches its config."""
    from epdserve.argtypes import config_from, flags_of
    from epdserve.engine.config import EngineConfig
    from epdserve.serving.router.app import RouterCommand
    from epdserve.serving.worker.setup import WORKER_FLAGS, WorkerConfig, add_arguments

    for config_class, add in ((WorkerConfig, add_arguments), (RouterCommand, None)):
        parser = argparse.ArgumentParser()
        (add or importlib.import_module("epdserve.serving.router.app").add_arguments)(parser)
        dests = {a.dest for a in parser._actions if a.dest != "help"}
        assert dests == {flag.kwargs.get("dest", flag.dest) for flag in flags_of(config_class)}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--role", "decode", "--router", "ipc://r", "--bind", "ipc://b", "--worker-id", "w",
                              "--block-size", "32", "--no-enforce-eager", "--dtype", "bfloat16", "-tp", "2"])
    config = config_from(WorkerConfig, args)
    assert (config.engine.block_size, config.engine.enforce_eager, config.engine.dtype) == (32, False, "bfloat16")
    assert config.tensor_parallel_size == 2 and config.auth.internal_encryption == "none"
    assert config.engine.max_num_seqs == EngineConfig().max_num_seqs  # each default declared once
    # serve passes the engine's and the hand-off's flags, not the worker's own (--kv-ttl, --role).
    passed = {flag.dest for flag in WORKER_FLAGS}
    assert {f.dest for f in flags_of(EngineConfig)} <= passed and "tensor_parallel_size" in passed
    assert not passed & {"kv_ttl", "role", "kv_bind", "auth_token"}


def test_parsed_options_are_frozen_and_copied_with_new_values():
    import dataclasses

    import pytest

    from epdserve.argtypes import add_flags, config_from
    from epdserve.model.tune import TuneOptions

    for command, (module, _) in COMMANDS.items():
        config_class = importlib.import_module(module).OPTIONS
        assert dataclasses.is_dataclass(config_class) and config_class.__dataclass_params__.frozen, command
    parser = argparse.ArgumentParser()
    add_flags(parser, TuneOptions)
    options = config_from(TuneOptions, parser.parse_args(["--threads", "1"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.model = "vlm"
    changed = dataclasses.replace(options, model="vlm")
    assert (changed.model, changed.threads, options.model) == ("vlm", [1], None)
