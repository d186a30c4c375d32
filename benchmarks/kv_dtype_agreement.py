"""How much KV compression on the wire (``--kv-transfer-dtype``) changes greedy output.

In one process, a prefill engine prefills each prompt once and hands its KV off through
a real shared-memory frame (none); the decode engine then continues from that KV as it
arrives (none), and from the same KV re-encoded as a bf16 and as an int8 frame
(:mod:`epdserve.transfer.kv_codec`, decoded back into the float32 cache). Prints, per
dtype: frame bytes per KV position, the ratio to none, the % of requests whose greedy
tokens all equal none's, and the mean % of positions whose token equals none's.

    .venv/bin/python benchmarks/kv_dtype_agreement.py [--prompts 50] [--max-tokens 32]

Prompts are chunks of 200–2,000 tokens (uniform, seeded) of the Python standard
library's source files: real, varied text and code that ships with every interpreter.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
import time
from pathlib import Path

import torch
import zmq

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import load_tokenizer
from epdserve.transfer import handoff, kv_codec, wire
from epdserve.transfer.loopback import first_output


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """``count`` token-id prompts of 200–2,000 tokens cut from stdlib sources."""
    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    while len(out) < count:
        ids = tokenizer(rng.choice(files).read_text(errors="replace")).input_ids
        n = rng.randint(200, 2000)
        if len(ids) >= n:
            start = rng.randint(0, len(ids) - n)
            out.append(ids[start:start + n])
    return out


def reencode(kv: torch.Tensor, transfer_dtype: str, num_tokens: int) -> tuple[torch.Tensor, int]:
    """``kv`` written into an in-memory frame as ``transfer_dtype`` and read back as
    float32; returns it and the frame's size in bytes."""
    header = wire.TensorHeader(tensors=kv_codec.specs(list(kv.shape), kv.dtype, transfer_dtype),
                               num_tokens=num_tokens, layout={})
    prefix = wire.header_bytes(header)
    frame = bytearray(wire.frame_size(header))
    frame[:len(prefix)] = prefix
    _, views = wire.parse(frame)
    kv_codec.encode(kv, views)
    _, tensors = wire.parse(frame)
    return kv_codec.decode(tensors, torch.float32), len(frame)


def decode_from(engine: LLMEngine, request_id: str, prompt: list[int], sampling: SamplingParams,
                kv: torch.Tensor, first: int) -> list[int]:
    engine.add_request(request_id, prompt, sampling, kv, first)
    tokens = [first]
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: a PD worker's share of a 2-core machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = resolve_model(None)
    tokenizer = load_tokenizer(info.path)
    prefill = LLMEngine(str(info.path), EngineConfig(kv_cache_memory_mb=256))
    decode = LLMEngine(str(info.path), EngineConfig(kv_cache_memory_mb=256))
    ctx = zmq.Context()
    exporter = handoff.Exporter(prefill, 600, ctx, None, "none")
    importer = handoff.Importer(ctx, "shm", 30)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    dtypes = kv_codec.TRANSFER_DTYPES
    frame_bytes = {d: 0 for d in dtypes}
    same_request = {d: 0 for d in dtypes}
    same_positions = {d: 0.0 for d in dtypes}
    positions = 0
    items = prompts(tokenizer, args.prompts, args.seed)
    start = time.perf_counter()
    for i, prompt in enumerate(items):
        rid = f"agree-{i}"
        prefill.add_request(rid, prompt, sampling, hold_kv=True)
        out = first_output(prefill, rid)
        desc = exporter.export(out)
        kv, _ = importer.take(rid, desc, decode.kv_layout(), decode.kv_cache.dtype)
        exporter.release(rid)
        tokens = {"none": decode_from(decode, f"{rid}-none", prompt, sampling, kv, out.token_ids[-1])}
        frame_bytes["none"] += desc.nbytes
        for d in dtypes[1:]:
            lossy, nbytes = reencode(kv, d, desc.num_tokens)
            tokens[d] = decode_from(decode, f"{rid}-{d}", prompt, sampling, lossy, out.token_ids[-1])
            frame_bytes[d] += nbytes
        positions += desc.num_tokens
        for d in dtypes:
            same = sum(a == b for a, b in zip(tokens[d], tokens["none"]))
            same_request[d] += tokens[d] == tokens["none"]
            same_positions[d] += same / len(tokens["none"])
        print(f"  {i + 1}/{len(items)}: {len(prompt)} tokens, "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        if (i + 1) % 10 == 0 or i + 1 == len(items):  # a long run shows its numbers as it goes
            done = items[:i + 1]
            lengths = [len(p) for p in done]
            print(f"\n{len(done)} prompts of {min(lengths)}–{max(lengths)} tokens (mean "
                  f"{sum(lengths) / len(lengths):.0f}), {args.max_tokens} greedy tokens each, model {info.name}, "
                  f"cache float32\n")
            print(f"{'dtype':<6} {'bytes/token':>12} {'vs none':>8} {'identical requests':>19} "
                  f"{'identical positions':>20}")
            for d in dtypes:
                per_token = frame_bytes[d] / positions
                print(f"{d:<6} {per_token:>12.0f} {per_token / (frame_bytes['none'] / positions):>8.3f} "
                      f"{100 * same_request[d] / len(done):>18.0f}% {100 * same_positions[d] / len(done):>19.1f}%",
                      flush=True)
    exporter.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
