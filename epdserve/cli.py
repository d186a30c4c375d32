"""The ``epdserve`` command: one sub-command per job.
Only the chosen sub-command's module is imported, so that a bench client never loads torch."""

from __future__ import annotations

import argparse
import importlib
import sys

from epdserve.argtypes import config_argv, config_from

COMMANDS = {
    "serve": ("epdserve.serving.launch.launcher", "start a router and its workers (colocated, PD or EPD)"),
    "worker": ("epdserve.serving.worker.engine_worker", "run one engine worker (colocated, encode, prefill or decode)"),
    "router": ("epdserve.serving.router.app", "run the OpenAI-compatible router alone"),
    "bench": ("epdserve.bench.run", "send a seeded workload to an OpenAI-compatible server"),
    "compare": ("epdserve.bench.compare", "run the same trace against each deployment"),
    "report": ("epdserve.bench.saved_report", "judge a saved compare run again against other SLOs, without running it"),
    "plan": ("epdserve.plan.run", "predict which deployment meets the SLOs at the lowest cost"),
    "tune": ("epdserve.model.tune", "measure this machine's kernel choices again and show them"),
}

# --config FILE, as vLLM's serve (compare and plan have --configs)
CONFIG_COMMANDS = ("serve", "router", "worker")


def main(argv: list[str] | None = None) -> None:
    """Exits with the command's status (2 on bad usage)."""
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="epdserve", description=__doc__.splitlines()[0])
    top.add_argument("command", choices=list(COMMANDS), help="; ".join(
        f"{name}: {text}" for name, (_, text) in COMMANDS.items()))
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv[:1])  # prints usage and exits 2 (or 0 for --help)
        return
    module_name, help_text = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"epdserve {argv[0]}", description=help_text)
    module.add_arguments(parser)
    args = argv[1:]
    if argv[0] in CONFIG_COMMANDS:
        parser.add_argument("--config", metavar="FILE",
                            help="YAML file of options (as vllm serve's --config): keys are the long option names "
                                 "without '--' ('-' or '_'), e.g. 'max-num-seqs: 8'; the command line wins")
        args = config_argv(parser, args)
    parsed = parser.parse_args(args)
    sys.exit(module.run(config_from(module.OPTIONS, parsed)))
