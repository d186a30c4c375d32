"""The server's per-request trace (``serve --trace-file``) summarised and joined with the client's
records by request id; the stages and the TTFT and hand-off breakdowns are defined in
docs/architecture.md, "Metric definitions". Event lines (an ``event`` key: an elastic router's
``role``, ``elastic_decision``, ``elastic_sample``) are not request records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.trace import RequestTrace

# RequestTrace attributes summarised (derived stages included).
FIELDS = ("kv_bytes", "kv_transfer_ms",
          # requests with images only
          "embedding_bytes", "embedding_transfer_ms", "embedding_bytes_per_image",
          "embedding_transfer_ms_per_image", "num_images", "encode_queue_ms", "encode_ms",
          "prefill_ms", "queue_ms", "decode_ms", "e2e_ms",
          "ttft_ms", "router_queue_ms", "prefill_queue_ms", "decode_queue_ms",
          "kv_export_ms", "kv_fetch_ms", "kv_import_ms", "router_hop_ms", "ttft_hop_ms",
          "first_decode_ms", "handoff_gap_ms", "handoff_hop_ms",
          "recomputed_tokens")
# Attribute divided by ``num_images``.
PER_IMAGE = {"embedding_bytes_per_image": "embedding_bytes",
             "embedding_transfer_ms_per_image": "embedding_transfer_ms"}


def _objects(path: Path):
    """A dict per non-blank line, None for a line that is not a JSON object."""
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        yield obj if isinstance(obj, dict) else None


def read(path: str | Path) -> tuple[list[RequestTrace], int]:
    """(records, malformed lines skipped); ([], 0) when absent. Event lines are neither."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for obj in _objects(path):
        if obj is not None and "event" in obj:
            continue
        try:
            records.append(RequestTrace.from_json(obj or {}))
        except ValidationError:
            bad += 1
    return records, bad


def events(path: str | Path, kind: str) -> list[dict]:
    """Event lines of ``kind`` with a numeric ``at`` (unix s), in file order."""
    path = Path(path)
    if not path.is_file():
        return []
    return [o for o in _objects(path) if o is not None and o.get("event") == kind
            and isinstance(o.get("at"), (int, float)) and not isinstance(o.get("at"), bool)]


# "draining": the router routes by the new role while the worker finishes its old role's work.
STATES = ("active", "draining")


def role_timeline(path: str | Path, end_unix: float | None = None) -> dict:
    """``{"workers": {id: [[start, end, role, state], ...]}, "switches": {"count",
    "requested", "drain_ms_p50", "drain_ms_max", "decisions"}}``, times in unix s; empty dicts
    without role lines. ``up`` and ``switched`` lines start an "active" interval, ``switching`` a
    "draining" one of the new role; the last ends at ``end_unix`` (None: the last event)."""
    roles = sorted(events(path, "role"), key=lambda o: o["at"])
    decisions = events(path, "elastic_decision")
    if not roles and not decisions:
        return {"workers": {}, "switches": {}}
    end = end_unix if end_unix is not None else max(o["at"] for o in roles + decisions)
    workers: dict[str, list[list]] = {}
    for o in roles:
        state = {"up": "active", "switching": "draining", "switched": "active"}.get(o.get("state"))
        if state is None or o.get("role") not in ENGINE_ROLES or not isinstance(o.get("worker"), str):
            continue  # a later format: not drawn rather than drawn wrong
        lane = workers.setdefault(o["worker"], [])
        if lane:
            lane[-1][1] = o["at"]
        lane.append([o["at"], None, o["role"], state])
    for lane in workers.values():
        lane[-1][1] = max(end, lane[-1][0])
    done = [o for o in roles if o.get("state") == "switched"]
    drains = [float(o["drain_ms"]) for o in done if isinstance(o.get("drain_ms"), (int, float))]
    return {"workers": workers, "switches": {
        "count": len(done), "requested": sum(o.get("state") == "switching" for o in roles),
        "drain_ms_p50": float(np.median(drains)) if drains else None,
        "drain_ms_max": max(drains) if drains else None,
        "decisions": [{k: o.get(k) for k in ("at", "action", "reason", "roles")} for o in decisions]}}


def _norm(request_id) -> str:
    s = str(request_id)
    for prefix in ("chatcmpl-", "cmpl-"):
        if s.startswith(prefix):
            return s[len(prefix):]
    return s


def summarize(path: str | Path, client_request_ids: list[str | None] = ()) -> dict:
    """``num_records``, ``matched_client_requests``, ``malformed_lines`` (when any), and mean
    and p95 (numpy linear) of each :data:`FIELDS` over the matched records (all when none match):
    bytes, ms or tokens per request, image fields over requests with images. ``{}`` when absent."""
    path = Path(path)
    if not path.is_file():
        return {}
    records, bad = read(path)
    ids = {_norm(x) for x in client_request_ids if x}
    matched = [r for r in records if _norm(r.request_id) in ids]
    use = matched if matched else records
    out: dict = {"num_records": len(records), "matched_client_requests": len(matched)}
    if bad:
        out["malformed_lines"] = bad
    for key in FIELDS:
        if key in PER_IMAGE:
            values = [getattr(r, PER_IMAGE[key]) / r.num_images for r in use
                      if getattr(r, PER_IMAGE[key]) is not None and r.num_images]
        else:
            values = [getattr(r, key) for r in use if getattr(r, key) is not None]
        if values:
            out[f"mean_{key}"] = float(np.mean(values))
            out[f"p95_{key}"] = float(np.percentile(values, 95))
    recomputed = [r.recomputed_tokens for r in use if r.recomputed_tokens is not None]
    if recomputed:
        out["total_recomputed_tokens"] = float(sum(recomputed))
        out["preempted_requests"] = sum(n > 0 for n in recomputed)
    out.update(by_transport(use))
    return out


# ``kv_tcp`` under ``--kv-transport auto``: shm within a node, TCP across nodes.
TRANSPORT_GROUPS = {0.0: "same_node", 1.0: "cross_node"}


def by_transport(records: list[RequestTrace]) -> dict:
    """KV bytes and transfer ms per request for shared-memory (``same_node``) and TCP
    (``cross_node``) hand-offs: ``{group}_requests``, ``mean_/p95_kv_bytes_{group}``,
    ``mean_/p95_kv_transfer_ms_{group}``."""
    out: dict = {}
    for tcp, group in TRANSPORT_GROUPS.items():
        rows = [r for r in records if r.kv_tcp == tcp and r.kv_transfer_ms is not None]
        if not rows:
            continue
        out[f"{group}_requests"] = len(rows)
        for key in ("kv_bytes", "kv_transfer_ms"):
            values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
            if values:
                out[f"mean_{key}_{group}"] = float(np.mean(values))
                out[f"p95_{key}_{group}"] = float(np.percentile(values, 95))
    return out


# The stages of each part of the client's TTFT by the request's ``path``, and of the PD
# hand-off gap, in time order; the KV export precedes the first token, so it is in TTFT.
_ROUTER, _PREFILL, _HOPS = ("router", "router_queue_ms"), ("prefill", "prefill_ms"), ("IPC hops", "ttft_hop_ms")
_ENCODE = (("encode queue", "encode_queue_ms"), ("encode", "encode_ms"),
           ("embedding transfer", "embedding_transfer_ms"))
TTFT_STAGES = {
    "colocated": (_ROUTER, *_ENCODE, ("queue", "colocated_queue_ms"), _PREFILL, _HOPS),
    "disaggregated": (_ROUTER, *_ENCODE, ("prefill queue", "prefill_queue_ms"), _PREFILL,
                      ("KV export", "kv_export_ms"), _HOPS),
    "local": (_ROUTER, *_ENCODE, ("decode queue", "decode_queue_ms"), _PREFILL, _HOPS),
}
HANDOFF_STAGES = (("router hop", "router_hop_ms"), ("KV fetch", "kv_fetch_ms"),
                  ("decode queue", "decode_queue_ms"), ("KV import", "kv_import_ms"),
                  ("first decode step", "first_decode_ms"), ("IPC hops", "handoff_hop_ms"))
PART_ORDER = {
    "ttft": ("http", "router", "encode queue", "encode", "embedding transfer", "queue",
             "prefill queue", "decode queue", "prefill", "KV export", "IPC hops", "other"),
    "handoff": ("http", *(p for p, _ in HANDOFF_STAGES), "other"),
}


def sort_parts(parts, which: str = "ttft") -> list[str]:
    """Unique names in ``PART_ORDER[which]`` order, unknown ones just before "other"."""
    order = PART_ORDER[which]
    rank = {p: i for i, p in enumerate(order)}
    return sorted(dict.fromkeys(parts), key=lambda p: rank.get(p, len(order) - 1.5))


def _stage_values(record: RequestTrace, stages) -> dict[str, float]:
    return {part: value for part, attr in stages if (value := getattr(record, attr)) is not None}


def ttft_parts(client_ttft_ms: float, record: RequestTrace) -> dict[str, float]:
    """One request's client TTFT (ms) split into parts that sum to it: ``http``, its path's
    stages, ``other``."""
    parts = {}
    if record.ttft_ms is not None:
        parts["http"] = client_ttft_ms - record.ttft_ms
    parts.update(_stage_values(record, TTFT_STAGES[record.path]))
    parts["other"] = client_ttft_ms - sum(parts.values())
    return parts


def handoff_parts(gap_ms: float, record: RequestTrace) -> dict[str, float]:
    """A PD request's client token 1 -> 2 gap (ms) split into parts that sum to it."""
    parts = {}
    if record.handoff_gap_ms is not None:
        parts["http"] = gap_ms - record.handoff_gap_ms
    parts.update(_stage_values(record, HANDOFF_STAGES))
    parts["other"] = gap_ms - sum(parts.values())
    return parts


def _mean_p95(rows: list[dict[str, float]], which: str) -> dict:
    """A part missing from a request counts 0 there."""
    parts = sort_parts((p for r in rows for p in r), which)
    cols = {p: np.array([r.get(p, 0.0) for r in rows]) for p in parts}
    return {"n": len(rows), "parts": parts,
            "mean": {p: float(np.mean(c)) for p, c in cols.items()},
            "p95": {p: float(np.percentile(c, 95)) for p, c in cols.items()}}


def breakdown(result: dict, records: list[RequestTrace]) -> dict:
    """``{"joined", "ttft": parts | None, "handoff": parts | None}``, parts being ``{"n", "parts",
    "mean", "p95"}`` in ms (means add up, p95s do not). ``result``'s times are seconds; a request
    is in ``handoff`` when its record has ``kv_import_ms`` and the client saw a second chunk."""
    by_id = {_norm(r.request_id): r for r in records}
    ttft_rows, gap_rows = [], []
    for i, rid in enumerate(result.get("request_ids") or []):
        rec = by_id.get(_norm(rid)) if rid and not result["errors"][i] else None
        if rec is None:
            continue
        ttft_rows.append(ttft_parts(result["ttfts"][i] * 1000.0, rec))
        if rec.kv_import_ms is not None and result["itls"][i]:
            gap_rows.append(handoff_parts(result["itls"][i][0] * 1000.0, rec))
    return {"joined": len(ttft_rows),
            "ttft": _mean_p95(ttft_rows, "ttft") if ttft_rows else None,
            "handoff": _mean_p95(gap_rows, "handoff") if gap_rows else None}
