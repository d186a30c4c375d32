"""The server's per-request trace (``epdserve serve --trace-file``), summarised.

The router appends one JSON object per finished request, with at least ``request_id``,
``prompt_tokens``, ``output_tokens``, ``queue_ms``, ``prefill_ms``, ``kv_bytes``,
``kv_transfer_ms``, ``decode_ms``, ``e2e_ms`` (``kv_*`` are 0 when colocated). Records are
joined with the client's view by ``request_id`` (the response ``id``); when no id
matches, every record of the file is used and the summary says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIELDS = ("kv_bytes", "kv_transfer_ms", "prefill_ms", "queue_ms", "decode_ms", "e2e_ms",
          # optional stage stamps, summarised when the server writes them
          "ttft_ms", "router_queue_ms", "prefill_queue_ms", "decode_queue_ms",
          "kv_export_ms", "kv_import_ms")


def read(path: str | Path) -> tuple[list[dict], int]:
    """(records, number of malformed lines skipped) of a trace file; ([], 0) if absent."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad


def _norm(request_id) -> str:
    s = str(request_id)
    for prefix in ("chatcmpl-", "cmpl-"):
        if s.startswith(prefix):
            return s[len(prefix):]
    return s


def summarize(path: str | Path, client_request_ids: list[str | None] = ()) -> dict:
    """Mean and p95 (numpy, linear) of each of :data:`FIELDS` present in the records of this
    run: ``mean_kv_bytes``, ``p95_kv_bytes``, ... (bytes and ms per request). Also
    ``num_records`` (lines in the file), ``matched_client_requests`` (records whose
    ``request_id`` is one of ``client_request_ids``) and ``malformed_lines`` when any.
    An absent file gives ``{}``."""
    path = Path(path)
    if not path.is_file():
        return {}
    records, bad = read(path)
    ids = {_norm(x) for x in client_request_ids if x}
    matched = [r for r in records if "request_id" in r and _norm(r["request_id"]) in ids]
    use = matched if matched else records
    out: dict = {"num_records": len(records), "matched_client_requests": len(matched)}
    if bad:
        out["malformed_lines"] = bad
    for key in FIELDS:
        values = [float(r[key]) for r in use
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values:
            out[f"mean_{key}"] = float(np.mean(values))
            out[f"p95_{key}"] = float(np.percentile(values, 95))
    return out
