"""Readers of public production traces: Mooncake's JSON lines (github.com/kvcache-ai/Mooncake;
``hash_ids`` of prefix-chained 512-token blocks) and Azure's LLM inference CSV
(github.com/Azure/AzurePublicDataset, the Splitwise traces; sizes only, no sharing). Rows
out of order are sorted stably and counted; errors are TraceError naming file:line and field."""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epdserve.bench.traces import TraceError

FORMATS = ("mooncake", "azure")
# AIPerf's and Dynamo's readers of the format use 512 too.
MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRow:
    """``timestamp_s``: arrival in s on the trace's clock (Mooncake ms / 1000; Azure: after the
    first row); lengths in tokens; ``hash_ids`` None when the format has none."""

    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TraceFile:
    """``reordered``: rows earlier than the row before them; ``hash_count_mismatches``: rows
    whose id count is not ceil(input_len / 512) (read as they are: ids beyond the prompt cover
    nothing, tokens beyond the ids are the request's own)."""

    path: str
    format: str
    rows: tuple[TraceRow, ...]
    reordered: int = 0
    hash_count_mismatches: int = 0


_RULES = {"timestamp": "a finite number >= 0 (milliseconds)",
          "input_length": "an integer >= 1", "output_length": "an integer >= 0",
          "hash_ids": "a list of integers >= 0",
          "TIMESTAMP": "a time like 2023-11-16 18:15:46.6805900",
          "ContextTokens": "an integer >= 1", "GeneratedTokens": "an integer >= 0"}


class _MooncakeRow(BaseModel):
    # strict: JSON 1.0 for an integer, true for a number or "3" are errors, not coerced.
    model_config = ConfigDict(strict=True, extra="ignore")
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    input_length: Annotated[int, Field(ge=1)]
    output_length: Annotated[int, Field(ge=0)]
    hash_ids: list[Annotated[int, Field(ge=0)]] | None = None


class _AzureRow(BaseModel):
    # lax: CSV cells are text; "12" (and "12.0") read as 12.
    model_config = ConfigDict(extra="ignore")
    ContextTokens: Annotated[int, Field(ge=1)]
    GeneratedTokens: Annotated[int, Field(ge=0)]


def _field_error(where: str, exc: ValidationError) -> TraceError:
    err = exc.errors()[0]
    name = str(err["loc"][0])
    if err["type"] == "missing":
        return TraceError(f"{where}: missing field {name!r} (must be {_RULES[name]})")
    item = f" (item {err['loc'][1]})" if len(err["loc"]) > 1 else ""
    return TraceError(f"{where}: field {name!r} must be {_RULES[name]}, got "
                      f"{err['input']!r}{item}")


def _open(path: Path):
    """Bad bytes become U+FFFD, so they fail as a bad field of their line."""
    try:
        return path.open(encoding="utf-8-sig", errors="replace", newline="")
    except OSError as exc:
        raise TraceError(f"trace file {path}: {exc.strerror or exc}") from None


def read_mooncake(path: str | Path) -> TraceFile:
    """Raises TraceError: missing, unreadable or empty file, or a bad line."""
    path = Path(path)
    with _open(path) as f:
        rows = [_mooncake_row(line, f"{path}:{num}") for num, line in enumerate(f, 1)
                if line.strip()]
    return _trace_file(path, "mooncake", rows)


def _mooncake_row(line: str, where: str) -> TraceRow:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f'{where}: expected a JSON object like {{"timestamp": 0, '
                         f'"input_length": 655, "output_length": 52, "hash_ids": [46, 47]}}')
    try:
        row = _MooncakeRow.model_validate(obj)
    except ValidationError as exc:
        raise _field_error(where, exc) from None
    ids = None if row.hash_ids is None else tuple(row.hash_ids)
    return TraceRow(row.timestamp / 1000.0, row.input_length, row.output_length, ids)


_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?"
                        r"(Z|[+-]\d{2}:\d{2})?")


def parse_azure_timestamp(text: str) -> float:
    """Unix seconds of ``2023-11-16 18:15:46.6805900`` (up to 9 fractional digits, which
    ``fromisoformat`` refuses before 3.11; optional ``Z`` or ``+HH:MM``, else UTC).

    Raises ValueError for anything else."""
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        raise ValueError(text)
    zone = m[3] or "+00:00"
    base = datetime.fromisoformat(m[1] + ("+00:00" if zone == "Z" else zone))
    fraction = int(m[2]) / 10 ** len(m[2]) if m[2] else 0.0
    return base.astimezone(timezone.utc).timestamp() + fraction


def read_azure(path: str | Path) -> TraceFile:
    """Raises TraceError: missing, unreadable or empty file, a missing column, or a bad cell."""
    path = Path(path)
    times: list[float] = []
    sizes: list[_AzureRow] = []
    with _open(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if reader.fieldnames and missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (the header "
                             f"must have {','.join(AZURE_COLUMNS)}; got "
                             f"{','.join(reader.fieldnames)})")
        for cells in reader:  # csv skips blank lines
            where = f"{path}:{reader.line_num}"
            try:
                times.append(parse_azure_timestamp(cells["TIMESTAMP"] or ""))
            except ValueError:
                raise TraceError(f"{where}: field 'TIMESTAMP' must be {_RULES['TIMESTAMP']}, "
                                 f"got {cells['TIMESTAMP']!r}") from None
            try:
                sizes.append(_AzureRow.model_validate(cells))
            except ValidationError as exc:
                raise _field_error(where, exc) from None
    first = min(times, default=0.0)
    rows = [TraceRow(t - first, s.ContextTokens, s.GeneratedTokens) for t, s in zip(times, sizes)]
    return _trace_file(path, "azure", rows)


def _trace_file(path: Path, fmt: str, rows: list[TraceRow]) -> TraceFile:
    """Raises TraceError when there are no rows."""
    if not rows:
        raise TraceError(f"trace file {path}: no requests ({fmt} format)")
    reordered = sum(b.timestamp_s < a.timestamp_s for a, b in zip(rows, rows[1:]))
    mismatches = sum(r.hash_ids is not None
                     and len(r.hash_ids) != math.ceil(r.input_len / MOONCAKE_BLOCK_TOKENS)
                     for r in rows)
    ordered = sorted(rows, key=lambda r: r.timestamp_s) if reordered else rows
    return TraceFile(str(path), fmt, tuple(ordered), reordered, mismatches)


def read_production(path: str | Path, fmt: str) -> TraceFile:
    """Raises TraceError: unknown format, a file of the other format, or a bad file."""
    if fmt not in FORMATS:
        raise TraceError(f"trace format {fmt!r}: use one of {', '.join(FORMATS)}")
    found = detect_format(path)
    if found not in (None, fmt):
        raise TraceError(f"trace file {path}: its first line is of the {found} format, not {fmt}")
    return read_mooncake(path) if fmt == "mooncake" else read_azure(path)


def detect_format(path: str | Path) -> str | None:
    """From the first non-blank line; None for neither (e.g. a ``--save-trace`` file).
    Raises TraceError when unreadable."""
    with _open(Path(path)) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        header = next(csv.reader([first]), [])
        return "azure" if all(c in header for c in AZURE_COLUMNS) else None
    return "mooncake" if isinstance(obj, dict) and "input_length" in obj else None
