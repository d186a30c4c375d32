"""benchmarks/decode_attention.py: a cell's times are positive and finite and its bytes are the
keys and values of every layer's cache it read; a malformed cell is refused with its text.
No speed is asserted."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from scripts import load_script

load_script("engine_limits")  # what the script imports by name
decode_attention = load_script("decode_attention")

CFG = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cell_counts_the_keys_and_values_it_reads(dtype):
    r = decode_attention.run_cell(CFG, batch=3, context=37, dtype=dtype, reps=2, seconds=5.0)
    assert r["bytes"] == 2 * 2 * 3 * 37 * 3 * 64 * (4 if dtype == torch.float32 else 2)
    assert 0 < r["best_ms"] <= r["median_ms"] and math.isfinite(r["median_ms"])
    assert r["gbs"] == pytest.approx(r["bytes"] / (r["median_ms"] / 1e3) / 1e9)
    assert r["kv_dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("text", ["32", "32x", "x320", "0x320", "32x-1", "axb"])
def test_a_malformed_cell_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match=text if text else "BATCHxCONTEXT"):
        decode_attention.cell(text)


def test_a_cell_parses_batch_and_context():
    assert decode_attention.cell("32x320") == (32, 320)
    assert decode_attention.cell("1X2048") == (1, 2048)
