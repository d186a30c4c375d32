"""Time of one KV hand-off (prefill done → KV usable in the decode engine's cache) over
shared memory and over TCP (127.0.0.1), against a plain memory copy of the same bytes;
and, with and without ``--kv-layer-pipeline``, the prefill time and hand-off time.

In one process, a prefill engine whose KV cache lives in a shared pool
(:func:`~epdserve.transfer.handoff.new_engine`) and a decode engine:

* Table 1: the prefill engine prefills a prompt of each size once; then, ``--reps`` times,
  an :class:`~epdserve.transfer.handoff.Exporter` hands those blocks over
  (``kv_export_ms``: nothing for held pool blocks, cache → /dev/shm for a staged frame),
  the decode side's :class:`~epdserve.transfer.handoff.Importer` copies them out of the
  pool or maps or fetches the frame (``kv_fetch_ms``), and the decode engine copies them
  into its cache (``kv_import_ms``, measured by the engine around the copy). Hand-off
  time = the sum of the three. Rows: "pool" = held blocks of the shared pool (a same-host
  decode worker copies them from its mapping of the pool; over TCP the prefill side builds
  the frame when asked), "staged" = a frame written to a /dev/shm segment at export. The
  first pool hand-off of a run also maps the pool (once per pair of workers), so it shows
  in p95, not p50. The reference is a copy of a buffer of the frame's size, measured in
  the same run: ``torch.clone`` and ``numpy.copy`` (into fresh memory) and ``copy_`` into
  a buffer written before ("into warm", as an import into a KV cache). "vs memcpy" is the
  fastest copy's p50 over the row's p50. Bandwidth = frame bytes / time (GB = 1e9 bytes).
  The rows run round-robin, so that load from other processes hits every row alike.
* Table 2: ``--prefill-reps`` full prefills per row, each followed by its hand-off, for a
  staged frame with and without the layer pipeline (which writes each layer's blocks into
  the frame as soon as the forward pass has computed it, so export only closes the frame),
  and for the pool. On a CPU the pipeline's copy is not free: it runs on the same core,
  inside the prefill step, so it moves time from the hand-off into ``prefill_ms`` (shown
  as ``kv_layer_copy_ms``, "layer copies in the prefill").

With ``--prefill-tp 2`` (or ``--decode-tp 2``) that engine is a tensor-parallel one, this
process its rank 0 and a follower process rank 1 (float32 weights), its KV cache one part
per rank (docs/tensor-parallel.md): the same tables for a hand-off across TP sizes, whose
frames have the same bytes as TP=1's.

    .venv/bin/python benchmarks/kv_handoff.py [--reps 20] [--prefill-reps 3] [--sizes 512 2048]
                                              [--prefill-tp N | --decode-tp N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import zmq

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.outputs import StepOutput
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.serving.worker.ranks import Ranks
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff
from epdserve.transfer.loopback import first_output

SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def seeded_prompt(engine: LLMEngine, size: int) -> list[int]:
    """``size`` random token ids, the same for a size in every table and run."""
    return torch.randint(0, engine.model.config.vocab_size, (size,),
                         generator=torch.Generator().manual_seed(size)).tolist()


def percentiles(ms: list[float]) -> tuple[float, float]:
    """p50 and p95 of ``ms`` (nearest rank)."""
    ordered = sorted(ms)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def copy_times(nbytes: int) -> dict[str, float]:
    """ms of one copy of ``nbytes`` bytes: ``torch.clone`` and ``numpy.copy`` (into fresh
    memory, as a staged frame is written) and ``Tensor.copy_`` into a buffer written before
    (as the import into a KV cache)."""
    src = torch.randn(nbytes // 4)
    warm = torch.zeros_like(src)
    times = {}
    for name, copy in (("memcpy (torch.clone)", src.clone), ("memcpy (numpy.copy)", lambda: np.copy(src.numpy())),
                       ("memcpy (into warm)", lambda: warm.copy_(src))):
        start = time.perf_counter()
        copy()
        times[name] = (time.perf_counter() - start) * 1e3
    return times


def hand_off(exporter: handoff.Exporter, importer: handoff.Importer, decode: LLMEngine, out: StepOutput,
             prompt: list[int]) -> tuple[dict[str, float], int]:
    """Export ``out``'s blocks, take them, import them into ``decode`` (one decode step) and
    release them; returns the parts in ms and the frame's size in bytes."""
    desc = exporter.export(out)
    kv, timings = importer.take(out.request_id, desc, decode.kv_layout(), decode.kv_cache.dtype)
    decode.add_request(out.request_id, prompt, SAMPLING, kv, out.token_ids[-1], timings=timings)
    del kv
    while decode.has_unfinished():
        for step_out in decode.step():
            timings.update(step_out.timings)
    exporter.release(out.request_id)  # as the router does after the decode side's first output
    parts = {"export": out.timings.kv_export_ms, "fetch": timings.kv_fetch_ms, "import": timings.kv_import_ms}
    return dict(parts, total=sum(parts.values())), desc.nbytes


def prefill_and_hand_offs(prefill: LLMEngine, exporter: handoff.Exporter, importer: handoff.Importer,
                          decode: LLMEngine, prompt: list[int], reps: int, label: str) -> dict[str, list[float]]:
    """``reps`` full prefills of ``prompt``, each handed off; ms per part and ``prefill``."""
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        rid = f"prefill-{len(prompt)}-{label}-{rep}"
        prefill.add_request(rid, prompt, SAMPLING, hold_kv=True, layer_sink=exporter.layer_sink)
        out = first_output(prefill, rid)
        parts, _ = hand_off(exporter, importer, decode, out, prompt)
        layers = out.timings.kv_layer_copy_ms or 0.0
        for key, ms in dict(parts, prefill=out.timings.prefill_ms, layers=layers).items():
            times.setdefault(key, []).append(ms)
    return times


def engines(model_dir: str, prefill_tp: int, decode_tp: int):
    """``(prefill engine, its shared pool, decode engine, ranks or None)``: the engine of a
    TP size above 1 is rank 0 of a group whose followers run pinned one a core."""
    ranks = None
    if max(prefill_tp, decode_tp) > 1:
        size = max(prefill_tp, decode_tp)
        ranks = Ranks.start(size, "bench", model_dir, "float32", "f32", "cpu", [[c % 2] for c in range(size)])
    config = EngineConfig(kv_cache_memory_mb=512)
    tp_config = EngineConfig(kv_cache_memory_mb=512, weight_format="f32")
    prefill, pool = new_engine(model_dir, tp_config if prefill_tp > 1 else config, True,
                               tp=ranks if prefill_tp > 1 else None)
    # Without a prefix cache: the same prompt is imported again and again, and every import must copy it.
    decode_config = replace(tp_config if decode_tp > 1 else config, enable_prefix_caching=False)
    decode = new_engine(model_dir, decode_config, False, tp=ranks if decode_tp > 1 else None)[0]
    return prefill, pool, decode, ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--prefill-reps", type=int, default=3, help="prefills per row of table 2 (0: skip it)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: a PD worker's share of a 2-core machine)")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of the prefill engine")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of the decode engine")
    args = parser.parse_args()
    if args.reps < 1 or args.prefill_reps < 0 or min(args.sizes) < 1:
        parser.error("--reps and --sizes must be at least 1, --prefill-reps at least 0")
    if min(args.prefill_tp, args.decode_tp) < 1 or min(args.prefill_tp, args.decode_tp) > 1:
        parser.error("--prefill-tp and --decode-tp: at least 1, and only one above 1 (one process group a process)")
    torch.set_num_threads(args.threads)
    info = resolve_model(None)
    prefill, pool, decode, ranks = engines(str(info.path), args.prefill_tp, args.decode_tp)
    if max(args.sizes) + SAMPLING.max_tokens > prefill.max_model_len:
        parser.error(f"--sizes: at most {prefill.max_model_len - SAMPLING.max_tokens} tokens")
    ctx = zmq.Context()
    bind = "tcp://127.0.0.1:0"
    exporters = {"pool": handoff.Exporter(prefill, 600, ctx, bind, "none", pool),
                 "staged": handoff.Exporter(prefill, 600, ctx, bind, "none")}
    importers = {"shm": handoff.Importer(ctx, "shm", 60), "tcp": handoff.Importer(ctx, "tcp", 60)}
    print(f"model {info.name}, float32 KV cache, torch threads {torch.get_num_threads()}, "
          f"prefill TP {args.prefill_tp}, decode TP {args.decode_tp}\n")
    print(f"Table 1: hand-off of the blocks of one prefill, {args.reps} times per row")
    print(f"{'tokens':>6} {'path':<21} {'MB':>7} {'p50 ms':>8} {'p95 ms':>8} {'GB/s p50':>9} {'vs memcpy':>10}"
          f"   p50 export / fetch / import ms")
    for size in args.sizes:
        prompt = seeded_prompt(prefill, size)
        rid = f"handoff-{size}"
        prefill.add_request(rid, prompt, SAMPLING, hold_kv=True)
        out = first_output(prefill, rid)
        rows: dict[str, dict[str, list[float]]] = {}
        for rep in range(args.reps):
            for kind in ("pool", "staged"):
                for transport, importer in importers.items():
                    # A fresh output over the same blocks: the engine keeps them (release_kv
                    # of an unknown id frees nothing).
                    copy = StepOutput(f"{rid}-{transport}-{kind}-{rep}", out.token_ids, kv_block_ids=out.kv_block_ids)
                    parts, nbytes = hand_off(exporters[kind], importer, decode, copy, prompt)
                    for key, ms in parts.items():
                        rows.setdefault(f"{transport} {kind}", {}).setdefault(key, []).append(ms)
            for name, ms in copy_times(nbytes).items():
                rows.setdefault(name, {}).setdefault("total", []).append(ms)
        # The faster of the two copies is the bar: it is what this machine's memory can do.
        memcpy_p50 = min(percentiles(rows[name]["total"])[0] for name in rows if name.startswith("memcpy"))
        for name, times in rows.items():
            p50, p95 = percentiles(times["total"])
            parts = " / ".join(f"{percentiles(times[k])[0]:.2f}" for k in ("export", "fetch", "import") if k in times)
            print(f"{size:>6} {name:<21} {nbytes / 1e6:>7.1f} {p50:>8.2f} {p95:>8.2f} "
                  f"{nbytes / (p50 / 1e3) / 1e9:>9.2f} {memcpy_p50 / p50:>10.2f}   {parts}", flush=True)
        prefill.release_kv(rid)
    if args.prefill_reps:
        print(f"\nTable 2: prefill, then hand-off; {args.prefill_reps} prefills per row (p50 ms)")
        print(f"{'tokens':>6} {'path':<31} {'prefill':>9} {'hand-off':>9} {'sum':>9}   export / fetch / import"
              f"   layer copies in the prefill")
        for size in args.sizes:
            prompt = seeded_prompt(prefill, size)
            for kind in ("staged", "staged+layer pipeline", "pool"):
                for transport, importer in importers.items():
                    # The pipelined exporter's layer sink goes with each request it exports.
                    pipelined = kind == "staged+layer pipeline"
                    exporter = (handoff.Exporter(prefill, 600, ctx, bind, "none", layer_pipeline=True)
                                if pipelined else exporters[kind])
                    times = prefill_and_hand_offs(prefill, exporter, importer, decode, prompt,
                                                  args.prefill_reps, f"{transport}-{kind}")
                    if pipelined:
                        exporter.close()
                    p50 = {k: percentiles(v)[0] for k, v in times.items()}
                    print(f"{size:>6} {transport + ' ' + kind:<31} {p50['prefill']:>9.1f} {p50['total']:>9.2f} "
                          f"{p50['prefill'] + p50['total']:>9.1f}   {p50['export']:.2f} / {p50['fetch']:.2f} / "
                          f"{p50['import']:.2f}   {p50['layers']:.2f}", flush=True)
    for exporter in exporters.values():
        exporter.close()
    ctx.destroy(linger=0)
    if ranks is not None:
        ranks.close()


if __name__ == "__main__":
    main()
