"""docs/flags.md is generated from the servers' option fields: it must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MAKE_FLAGS = Path(__file__).resolve().parent.parent / "docs" / "make_flags.py"


def test_flags_reference_is_up_to_date(monkeypatch):
    for name in ("EPDSERVE_AUTH_TOKEN", "EPDSERVE_ALLOW_UNAUTHENTICATED", "EPDSERVE_INTERNAL_ENCRYPTION"):
        monkeypatch.delenv(name, raising=False)  # the security flags' defaults come from the environment
    spec = importlib.util.spec_from_file_location("make_flags", MAKE_FLAGS)
    make_flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_flags)
    assert make_flags.OUT.read_text() == make_flags.render(), "stale: run .venv/bin/python docs/make_flags.py"
    assert "| `--kv-cache-memory-mb` | `1024` | KV cache budget per worker (MiB) |" in make_flags.render()
