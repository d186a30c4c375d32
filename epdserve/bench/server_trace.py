"""The server's per-request trace (``epdserve serve --trace-file``), summarised.

The router appends one JSON line per finished request: a
:class:`~epdserve.trace.RequestTrace` (:meth:`~epdserve.trace.RequestTrace.as_json`; every
stage is defined in :mod:`epdserve.trace`). :func:`read` reads the lines back as
``RequestTrace`` records (:meth:`~epdserve.trace.RequestTrace.from_json`, older trace files
too), joined with the client's view by ``request_id`` (the response ``id``):
:func:`summarize` gives each stage's mean and p95, :func:`breakdown` splits each request's
client TTFT (and PD hand-off gap) into stages. Stages a server did not measure are left
out, never guessed: image stages exist only for requests with images, ``kv_*`` are 0 when
colocated.

Beside the request records, the router of an elastic deployment (``serve --elastic``)
writes event lines, JSON objects with an ``event`` key (request records never have one):
``role`` (a worker admitted in a role, asked to switch, or done switching),
``elastic_decision`` and ``elastic_sample`` (the format: in
docs/comparing.md). :func:`read` skips them; :func:`role_timeline` reads the roles over
time and the switches from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.trace import RequestTrace

# RequestTrace attributes summarised (derived stages included).
FIELDS = ("kv_bytes", "kv_transfer_ms",
          # requests with images only (means over those requests): embeddings beside KV
          "embedding_bytes", "embedding_transfer_ms", "embedding_bytes_per_image",
          "embedding_transfer_ms_per_image", "num_images", "encode_queue_ms", "encode_ms",
          "prefill_ms", "queue_ms", "decode_ms", "e2e_ms",
          # optional stage stamps, summarised when the server writes them
          "ttft_ms", "router_queue_ms", "prefill_queue_ms", "decode_queue_ms",
          "kv_export_ms", "kv_fetch_ms", "kv_import_ms", "router_hop_ms", "ttft_hop_ms",
          "first_decode_ms", "handoff_gap_ms", "handoff_hop_ms",
          # tokens computed again after a preemption, per request (0 when never preempted)
          "recomputed_tokens")
# Fields a record does not carry but its attributes give: name -> the attribute divided
# by ``num_images``.
PER_IMAGE = {"embedding_bytes_per_image": "embedding_bytes",
             "embedding_transfer_ms_per_image": "embedding_transfer_ms"}


def _objects(path: Path):
    """Each line of a trace file parsed: a dict, or None for a line that is not a JSON
    object (blank lines left out)."""
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        yield obj if isinstance(obj, dict) else None


def read(path: str | Path) -> tuple[list[RequestTrace], int]:
    """(records, number of malformed lines skipped: not JSON, or not a trace record) of a
    trace file; ([], 0) if absent. Event lines (an ``event`` key: module doc) are neither
    records nor malformed."""
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
    """The event lines of a trace file whose ``event`` is ``kind`` (``role``,
    ``elastic_decision``, ``elastic_sample``), in file order, without a line whose ``at``
    (unix s) is not a number; [] if the file is absent."""
    path = Path(path)
    if not path.is_file():
        return []
    return [o for o in _objects(path) if o is not None and o.get("event") == kind
            and isinstance(o.get("at"), (int, float)) and not isinstance(o.get("at"), bool)]


# An interval's state: the worker serves its role ("active"), or the router already routes
# it by its new role while it finishes its old role's work ("draining": from its
# ``switching`` line to its ``switched`` line).
STATES = ("active", "draining")


def role_timeline(path: str | Path, end_unix: float | None = None) -> dict:
    """The roles of each worker over time and the role switches, from the ``role``,
    ``elastic_decision`` lines of a router trace file (module doc).

    Returns ``{"workers": {worker id: [[start, end, role, state], ...]}, "switches":
    {"count", "requested", "drain_ms_p50", "drain_ms_max", "decisions": [{"at", "action",
    "reason", "roles"}]}}``, times in unix seconds (``time.time()``, as the lines have them),
    intervals in time order; ``{"workers": {}, "switches": {}}`` without role lines. A ``up``
    line starts an "active" interval of its role, a ``switching`` line a "draining" one of
    the new role (the router routes by it from then), a ``switched`` line an "active" one;
    each ends where the worker's next one starts, the last at ``end_unix`` (None: the last
    event's time). ``count``: switches done (``switched`` lines); ``requested``:
    ``switching`` lines; ``drain_ms_p50`` (numpy median) and ``drain_ms_max`` over the
    ``switched`` lines' ``drain_ms`` (None when there is none).
    """
    roles = sorted(events(path, "role"), key=lambda o: o["at"])
    decisions = events(path, "elastic_decision")
    if not roles and not decisions:
        return {"workers": {}, "switches": {}}
    end = end_unix if end_unix is not None else max(o["at"] for o in roles + decisions)
    workers: dict[str, list[list]] = {}
    for o in roles:
        state = {"up": "active", "switching": "draining", "switched": "active"}.get(o.get("state"))
        if state is None or o.get("role") not in ENGINE_ROLES or not isinstance(o.get("worker"), str):
            continue  # a line of a later format: not drawn rather than drawn wrong
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
    """Mean and p95 (numpy, linear) of each of :data:`FIELDS` that the records of this run
    have: ``mean_kv_bytes``, ``p95_kv_bytes``, ... (bytes and ms per request, over the
    records where it is not None: the image fields over requests with images), and of the
    :data:`PER_IMAGE` fields (a record's value / its ``num_images``), and
    ``total_recomputed_tokens`` with ``preempted_requests`` (records that recomputed any). Also ``num_records`` (the file's trace records),
    ``matched_client_requests`` (records whose ``request_id`` is one of
    ``client_request_ids``) and ``malformed_lines`` when any. An absent file gives ``{}``."""
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


# A hand-off's transport (the trace's ``kv_tcp``) by the name summaries give it: with
# ``--kv-transport auto`` (the default) shared memory means producer and consumer on the
# same node (host), TCP on different ones (epdserve.transfer.handoff.host_id).
TRANSPORT_GROUPS = {0.0: "same_node", 1.0: "cross_node"}


def by_transport(records: list[RequestTrace]) -> dict:
    """KV bytes and transfer time per request, separately for the hand-offs made by shared
    memory (``same_node``) and over TCP (``cross_node``): ``{group}_requests``,
    ``mean_kv_bytes_{group}``, ``p95_kv_bytes_{group}``, ``mean_kv_transfer_ms_{group}``,
    ``p95_kv_transfer_ms_{group}`` (bytes, ms; numpy linear p95) for each group that has
    hand-offs; records without one (colocated, local prefill) are left out."""
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


# --------------------------------------------------------------- end-to-end breakdown
#
# Which RequestTrace stages make up which part of the client's TTFT, and of the PD
# hand-off gap (client: token 1 -> token 2), in time order: (part, attribute; a stage that
# is None is absent), as :mod:`epdserve.trace` defines them. TTFT stages depend on the
# request's ``path``: colocated, disaggregated (prefill worker then decode worker) or local
# (a PD request the decode worker prefilled itself). The prefill worker exports the KV
# before it sends the first token, so the export is part of TTFT, not of the hand-off gap.
# Image encoding (its queue, the encoding, and in EPD the embedding hand-off) comes before
# the first worker's queue on every path, whichever worker encodes; text-only requests
# lack its stages, so it is absent for them.
# "http" (client TTFT - the router's ttft_ms: client send, HTTP parsing, SSE write; for
# the hand-off gap, the client's gap - the router's handoff_gap_ms: the second token's SSE
# write less the first's) and "other" (what no measured stage covers; 0 when the record
# has the router's stamp, ttft_ms / handoff_gap_ms, and every stage) are added by
# :func:`ttft_parts` / :func:`handoff_parts`. In the hand-off gap, "first decode step" is
# the rest of the decode worker's step that imports the KV (batched with its running
# requests) and "IPC hops" the router's remainder (the AddRequest's and the second
# token's ZeroMQ and event-loop hops).
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
# Every part in time order, for tables and plots that put several configurations together.
PART_ORDER = {
    "ttft": ("http", "router", "encode queue", "encode", "embedding transfer", "queue",
             "prefill queue", "decode queue", "prefill", "KV export", "IPC hops", "other"),
    "handoff": ("http", *(p for p, _ in HANDOFF_STAGES), "other"),
}


def sort_parts(parts, which: str = "ttft") -> list[str]:
    """Unique part names in the order of ``PART_ORDER[which]`` (unknown ones just before
    "other")."""
    order = PART_ORDER[which]
    rank = {p: i for i, p in enumerate(order)}
    return sorted(dict.fromkeys(parts), key=lambda p: rank.get(p, len(order) - 1.5))


def _stage_values(record: RequestTrace, stages) -> dict[str, float]:
    """Each stage's value (ms), for the stages the record has."""
    return {part: value for part, attr in stages if (value := getattr(record, attr)) is not None}


def ttft_parts(client_ttft_ms: float, record: RequestTrace) -> dict[str, float]:
    """The client's TTFT of one request (ms) split into parts (ms) that sum to it:
    ``http`` (client TTFT - server ``ttft_ms``; absent when the record has no
    ``ttft_ms``), the stages of :data:`TTFT_STAGES` for the record's ``path`` that it has,
    and ``other`` = client TTFT - all of those (what no stage covers; 0 when the record
    has ``ttft_hop_ms``)."""
    parts = {}
    if record.ttft_ms is not None:
        parts["http"] = client_ttft_ms - record.ttft_ms
    parts.update(_stage_values(record, TTFT_STAGES[record.path]))
    parts["other"] = client_ttft_ms - sum(parts.values())
    return parts


def handoff_parts(gap_ms: float, record: RequestTrace) -> dict[str, float]:
    """A PD request's hand-off gap (client: first -> second text chunk, ms) split into
    parts (ms) that sum to it: ``http`` (the client's gap - the router's
    ``handoff_gap_ms``; absent when the record has none), the stages of
    :data:`HANDOFF_STAGES` the record has (``IPC hops``: the router's remainder,
    ``handoff_hop_ms``), and ``other`` = gap - all of those (0 when the record has
    ``handoff_hop_ms``; in an older record without ``first_decode_ms``, the decode worker's
    first step and the IPC hops)."""
    parts = {}
    if record.handoff_gap_ms is not None:
        parts["http"] = gap_ms - record.handoff_gap_ms
    parts.update(_stage_values(record, HANDOFF_STAGES))
    parts["other"] = gap_ms - sum(parts.values())
    return parts


def _mean_p95(rows: list[dict[str, float]], which: str) -> dict:
    """``{"n", "parts": [...], "mean": {part: ms}, "p95": {part: ms}}`` over per-request
    part dicts (a part missing from a request counts 0 there; numpy linear p95)."""
    parts = sort_parts((p for r in rows for p in r), which)
    cols = {p: np.array([r.get(p, 0.0) for r in rows]) for p in parts}
    return {"n": len(rows), "parts": parts,
            "mean": {p: float(np.mean(c)) for p, c in cols.items()},
            "p95": {p: float(np.percentile(c, 95)) for p, c in cols.items()}}


def breakdown(result: dict, records: list[RequestTrace]) -> dict:
    """Join a bench result's completed requests with server ``records`` (:func:`read`) by
    request id and split their TTFT (and, for requests with a PD hand-off, the token 1 -> 2
    gap) into stages; see :func:`ttft_parts` and :func:`handoff_parts`.

    ``result``: a bench result dict (``request_ids``, ``errors``, ``ttfts`` and ``itls``
    in seconds). Returns ``{"joined": n, "ttft": <parts>, "handoff": <parts> | None}``,
    where <parts> is ``{"n", "parts", "mean": {part: ms}, "p95": {part: ms}}`` (p95 of each
    part alone: p95s do not add up, means do); ``ttft`` is None when nothing joined.
    A request counts in ``handoff`` when its record has ``kv_import_ms`` and the client
    saw a second chunk.
    """
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
