"""``plan --question goodput``: each deployment simulated once on the trace as sent, judged as a
compare run is (same rules, paired interval over the requests, SLO map), so predicted and
measured maps of one trace can be laid side by side."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tqdm import tqdm

from epdserve import extras
from epdserve.bench import metrics, paired, saved_report, slo_map, workload
from epdserve.plan import replay
from epdserve.plan.costmodel import NoStepModel, Platform
from epdserve.plan.simulate import Deployment, EngineLimits, KVCapacityError, serve

QUESTIONS = ("capacity", "goodput")


def entry(deployment: Deployment, platform: Platform, requests: list[workload.Request], limits: EngineLimits,
          slos_ms: dict[str, float], device_kind: str) -> dict:
    """A compare entry: ``name``, ``mode``, ``result`` against ``slos_ms``, ``per_run``,
    ``resources``. Raises KVCapacityError, ValueError as simulate."""
    sim = serve(deployment, platform, requests, limits)
    return as_entry(deployment, metrics.compute(sim.results(range(len(requests)))[0], slos_ms), device_kind)


def as_entry(deployment: Deployment, result: dict, device_kind: str) -> dict:
    return {"name": deployment.name, "mode": deployment.mode, "result": result,
            "per_run": [paired.outcomes(result)],
            "resources": {"device_kind": device_kind, "num_devices": deployment.devices}}


def plan(deployments: list[tuple[Deployment, EngineLimits]], platform: Platform,
         requests: list[workload.Request], slos_ms: dict[str, float], device_kind: str, given: list | None,
         out_dir: Path, workload_text: str, devices: int) -> tuple[str, list[Path]]:
    """Writes plan.json, plan.md and the map's PNG; returns plan.md's text and the files.

    Raises ValueError: a trace sent all at once (no rate of its own), or every deployment skipped."""
    if replay.sent_at_once(requests):
        raise ValueError("--question goodput: the trace is sent all at once and has no arrivals of its own; give a "
                         "--trace with them (a compare run's trace.jsonl, a production trace) or ask for capacity")
    entries, skipped = [], {}
    for dep, limits in tqdm(deployments, desc="plan", unit="deployment"):
        try:
            entries.append(entry(dep, platform, requests, limits, slos_ms, device_kind))
        except (KVCapacityError, NoStepModel) as exc:
            skipped[dep.name] = str(exc)
    if not entries:
        raise ValueError(f"every deployment was skipped: {skipped}")
    out_dir.mkdir(parents=True, exist_ok=True)
    v = verdict(entries, slos_ms, given, out_dir)
    doc = {"question": "goodput", "platform": platform.name, "devices": devices, "workload": workload_text,
           "slos_ms": slos_ms, "rows": sorted((row(e) for e in entries), key=lambda r: -r["goodput_per_device"]),
           "skipped": skipped, "recommendation": v["cell"]["winner"], "verdict": v["text"], "cell": v["cell"],
           "region": v["region"], "slo_map": v["map"]}
    (out_dir / "plan.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc, v["section"])
    (out_dir / "plan.md").write_text(text)
    return text, [out_dir / "plan.md", out_dir / "plan.json"] + v["pngs"]


def row(e: dict) -> dict:
    """Goodput req/s (and per device), attainment, TTFT and ITL p50/p95 ms, output tok/s per device."""
    r, n = e["result"], e["resources"]["num_devices"]
    return {"name": e["name"], "devices": n, "goodput_rps": r["request_goodput"],
            "goodput_per_device": r["request_goodput"] / n, "slo_attainment": r["slo_attainment"],
            "p50_ttft_ms": r["median_ttft_ms"], "p95_ttft_ms": r["p95_ttft_ms"],
            "p50_itl_ms": r["median_itl_ms"], "p95_itl_ms": r["p95_itl_ms"],
            "output_tok_s_per_device": r["output_throughput"] / n}


def verdict(entries: list[dict], slos_ms: dict[str, float], given: list | None, out_dir: Path) -> dict:
    """``{"cell", "text", "region", "map", "section", "pngs"}`` at ``slos_ms``."""
    c = slo_map.cell(entries, slos_ms)
    m, section, pngs = slo_map.for_outputs(entries, slos_ms, given, out_dir)
    return {"cell": c, "text": slo_map.describe(c), "map": m, "section": section, "pngs": pngs,
            "region": slo_map.region(m, slos_ms) if "cells" in m else None}


def agreement(predicted: dict, measured: dict) -> dict:
    """Cell counts over verdicts shown better: ``same`` winner, ``opposite``, ``predicted_only``,
    ``measured_only``, ``neither``, and ``cells``. Raises ValueError for maps of different axes."""
    if predicted["axes"] != measured["axes"]:
        raise ValueError(f"maps of different SLO grids: {predicted['axes']} vs {measured['axes']}")
    counts = dict.fromkeys(("same", "opposite", "predicted_only", "measured_only", "neither"), 0)
    for p, m in zip(itertools.chain(*predicted["cells"]), itertools.chain(*measured["cells"])):
        shown = (p["verdict"] == "better", m["verdict"] == "better")
        key = {(True, True): "same" if p["winner"] == m["winner"] else "opposite", (True, False): "predicted_only",
               (False, True): "measured_only", (False, False): "neither"}[shown]
        counts[key] += 1
    return {**counts, "cells": sum(counts.values())}


def agreement_line(a: dict) -> str:
    return (f"of {a['cells']} cells, {a['same']} show the same winner better in both maps and {a['opposite']} "
            f"opposite winners; {a['predicted_only']} are shown better only in the prediction, "
            f"{a['measured_only']} only in the measurement, {a['neither']} in neither (ties, no difference shown)")


def markdown(doc: dict, section: str) -> str:
    slos = " ".join(f"{k} ≤ {v:g} ms" for k, v in doc["slos_ms"].items())
    lines = [f"# Plan: {doc['platform']}, {doc['devices']} devices: goodput at the trace's own arrivals", "",
             f"Workload: {doc['workload']}. SLOs: {slos}. The question: requests per second within the SLOs "
             "with the trace sent as it is, as `epdserve compare` measures it, each deployment simulated once "
             "(`--question capacity` asks for the highest rate that keeps --target of them within).", "",
             "| deployment | devices | goodput req/s | per device | within the SLOs | TTFT p50/p95 ms "
             "| ITL p50/p95 ms | out tok/s/device |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['name']} | {r['devices']} | {r['goodput_rps']:.3g} | {r['goodput_per_device']:.3g} | "
                     f"{r['slo_attainment']:.0%} | {r['p50_ttft_ms']:.0f} / {r['p95_ttft_ms']:.0f} | "
                     f"{r['p50_itl_ms']:.1f} / {r['p95_itl_ms']:.1f} | {r['output_tok_s_per_device']:.3g} |")
    lines += [f"| {name} | skipped: {why} |||||||" for name, why in doc["skipped"].items()]
    lines += ["", f"**At these SLOs: {doc['verdict']}** — judged as compare judges (epdserve/bench/rules.py), "
              "the interval paired over the requests of one simulated run each: it covers the requests, not "
              "the model's error (`epdserve plan validate`).", ""]
    if doc["region"]:
        lines += [f"Who wins at other SLOs: {doc['region']}.", ""]
    return "\n".join(lines) + "\n" + section


def side_by_side(compare_dirs: list[Path], predicted: list[dict], given: list | None, out_dir: Path) -> str:
    """Measured map of saved runs (pooled, at compare's SLOs) beside the predicted one, with
    their agreement, PNGs drawn into ``out_dir``; one line instead for runs without per-request
    values. Raises ValueError as :func:`agreement`."""
    try:
        saved = [saved_report.load(d) for d in compare_dirs]
        names = {e["name"] for e in predicted}
        measured_entries = [e for e in saved_report.pooled(saved, compare_dirs) if e["name"] in names]
        slos = saved[0]["recommendation"]["slos_ms"]
        axes = slo_map.grid(slos, given)
        measured = slo_map.slo_map(measured_entries, slos, axes)
    except ValueError as exc:  # saved_report.Refused, rejudge.SavedRunError
        return f"No map of who wins at which SLOs: {exc}\n"
    maps = {"predicted": slo_map.slo_map(predicted, slos, axes), "measured": measured}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, m in maps.items():
        try:
            slo_map.plot(m, out_dir / f"slo_map_{name}.png")
        except extras.MissingExtra as exc:
            extras.warn_skipped(exc)
    return "\n\n".join(f"Who wins at which SLOs, {name} (the same requests judged on a grid of SLOs):\n\n"
                       f"{slo_map.markdown(m)}" for name, m in maps.items()) \
        + f"\n\nThe maps agree: {agreement_line(agreement(maps['predicted'], measured))}.\n"
