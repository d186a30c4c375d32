"""``epdserve report DIR [DIR ...]``: saved comparisons of one trace judged again against other
SLOs, without running them, written as compare writes them; refusals (exit 2, nothing
written) are listed in docs/comparing.md, "Who wins at which SLOs"."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from epdserve.argtypes import add_flags, field_of, setting
from epdserve.bench import compare, paired, recommend, rejudge, slo_map, workload
from epdserve.bench.run import parse_goodput


FiniteMs = Annotated[float, Field(allow_inf_nan=False)]


class Refused(ValueError):
    """The message names the directory or value and why."""


@dataclass(frozen=True)
class ReportOptions:
    dirs: list[str] = field(default_factory=list, metadata=setting(
        "epdserve compare --output directories of one trace", "dirs", nargs="+", metavar="DIR"))
    goodput: list[tuple[str, float]] | None = field(default=None, metadata=setting(
        "the SLOs to judge by, as compare's --goodput (default: the ones the run was judged by)", nargs="+",
        type=parse_goodput, metavar="KEY:MS"))
    slo_grid: list | None = field_of(slo_map.SLO_GRID_FLAG)
    output: str | None = field(default=None, metadata=setting(
        "where the report goes (default: the first DIR's report/)", metavar="DIR"))


OPTIONS = ReportOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ReportOptions)


class _Outcomes(BaseModel):
    model_config = ConfigDict(extra="allow")
    good: list[bool]
    ttft_ms: list[FiniteMs | None]
    tpot_ms: list[FiniteMs | None]
    e2el_ms: list[FiniteMs | None]
    max_itl_ms: list[FiniteMs | None]
    itl_p99_ms: list[FiniteMs | None]
    duration_s: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_length(self) -> "_Outcomes":
        if len({len(getattr(self, k)) for k in ("good", *paired.SLO_VALUES.values())}) != 1:
            raise ValueError("its per-request lists differ in length")
        return self


class _Entry(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    per_run: list[_Outcomes] | None = None
    result: dict | None = None


class _Saved(BaseModel):
    """Unique names, and every run of one trace (the same request count)."""

    model_config = ConfigDict(extra="allow")
    trace: dict[str, object]
    configs: list[_Entry] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> "_Saved":
        names = [e.name for e in self.configs]
        if len(set(names)) != len(names):
            raise ValueError(f"configuration names repeat: {names}")
        counts = {len(r.good) for e in self.configs for r in e.per_run or ()}
        if len(counts) > 1:
            raise ValueError(f"runs of different request counts {sorted(counts)}: not one trace")
        if not isinstance(self.trace.get("sha256"), str):
            raise ValueError("trace.sha256: missing")
        return self


def load(directory: Path) -> dict:
    """compare.json with ``requests`` (its trace). Raises Refused: missing, unreadable, another
    layout, malformed, or a trace.jsonl changed since compare wrote it."""
    path = directory / "compare.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Refused(f"{path}: not a saved comparison ({exc})") from None
    version = saved.get("version", 1) if isinstance(saved, dict) else None
    if type(version) is not int:
        raise Refused(f"{path}: not a saved comparison (no layout version)")
    if version != compare.VERSION:
        age = "an older" if version < compare.VERSION else "a newer"
        raise Refused(f"{path}: saved by {age} epdserve (layout {version}; this one reads {compare.VERSION}, with "
                      "every SLO's per-request values): run compare again")
    try:
        _Saved.model_validate(saved)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise Refused(f"{path}: {where + ': ' if where else ''}{first['msg']}") from None
    trace = directory / "trace.jsonl"
    try:
        saved["requests"] = workload.load_trace(trace)
    except workload.TraceError as exc:
        raise Refused(str(exc)) from None
    if hashlib.sha256(trace.read_bytes()).hexdigest() != saved["trace"]["sha256"]:
        raise Refused(f"{trace}: not the trace compare ran (its sha256 differs from compare.json's)")
    return saved


def pooled(saved: list[dict], dirs: list[Path]) -> list[dict]:
    """Each deployment's runs pooled in the order given; a failure in one directory yields to
    runs in another. Raises Refused for different traces."""
    first = saved[0]["trace"]["sha256"]
    for s, d in zip(saved[1:], dirs[1:]):
        if s["trace"]["sha256"] != first:
            raise Refused(f"{d}: another trace than {dirs[0]}'s (trace.jsonl sha256 {s['trace']['sha256'][:12]} "
                          f"vs {first[:12]}): pool only runs of one trace")
    entries: dict[str, dict] = {}
    for s in saved:
        for e in s["configs"]:
            kept = entries.get(e["name"])
            if kept is None or "result" not in kept:
                entries[e["name"]] = dict(e)
            elif "result" in e:
                entries[e["name"]] = {**kept, "per_run": kept.get("per_run", []) + e.get("per_run", []),
                                      "runs": kept.get("runs", []) + e.get("runs", []), "spread": kept.get("spread") or {}}
    return list(entries.values())


def _options_error(args: ReportOptions, dirs: list[Path]) -> str | None:
    twice = [d for i, d in enumerate(dirs) if d.resolve() in [x.resolve() for x in dirs[:i]]]
    if twice:
        return f"{twice[0]}: given twice (its runs would count twice)"
    keys = [k for k, _ in args.goodput or ()]
    if len(set(keys)) != len(keys):
        return f"--goodput: {sorted(k for k in set(keys) if keys.count(k) > 1)[0]} given twice"
    if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
        return f"--output {args.output}: not a directory"
    return slo_map.check_given(args.slo_grid)


def run(args: ReportOptions) -> int:
    dirs = [Path(d) for d in args.dirs]
    error = _options_error(args, dirs)
    if error:
        print(f"epdserve report: error: {error}", file=sys.stderr)
        return 2
    try:
        saved = [load(d) for d in dirs]
        entries = pooled(saved, dirs)
        was = recommend.recommend(entries)
        slos = dict(args.goodput) if args.goodput else was["slos_ms"]
        judged = rejudge.judge(entries, slos, default=not args.goodput and was["slos_default"])
    except ValueError as exc:  # Refused, rejudge.SavedRunError, a bad SLO
        print(f"epdserve report: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.output) if args.output else dirs[0] / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    first = saved[0]
    spec = {k: v for k, v in first["trace"].items() if k not in ("file", "num_requests", "sha256")}
    stopped = first["recommendation"].get("stopped", "") if len(dirs) == 1 else ""
    rec = {**recommend.recommend(judged), "stopped": stopped, "judged_again_from": [str(d) for d in dirs]}
    sampling = {**first.get("sampling", {}), "slo_grid": args.slo_grid}
    files = compare.write_outputs(judged, first["requests"], spec, out_dir, sampling, rec)
    compare.print_summary(judged, rec, out_dir, files)
    return 0
