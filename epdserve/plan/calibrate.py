"""``epdserve plan calibrate``: time this machine's engine steps (workers of 1 and 2 cores, and of
2 tensor-parallel ranks), the vision tower's encode per tile and a shared-memory KV hand-off,
fit the cost model, and read the calibration back as a :class:`Platform` (docs/planner.md)."""

from __future__ import annotations

import json
import os
import platform as host
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import zmq
from tqdm import tqdm

from epdserve.bench.images import image_bytes
from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.kv_source import TensorKV
from epdserve.engine.request import SamplingParams
from epdserve.model.image_processor import ImageProcessor
from epdserve.model.loader import DEFAULT_VLM, resolve_model
from epdserve.model.tokenizer import chat_prompt_ids, load_tokenizer
from epdserve.plan.costmodel import FEATURES, ImageCost, LinearStep, Link, NoStepModel, Platform
from epdserve.plan.model_spec import ModelSpec
from epdserve.plan.serving_fit import step_uncertainty
from epdserve.model.image_processor import ImageInput
from epdserve.serving.worker.ranks import Ranks
from epdserve.serving.worker.setup import new_engine
from epdserve.transfer import handoff, loopback

CACHE_DIR = Path.home() / ".cache" / "epdserve" / "calibration"
PREFILL_LENS = (16, 64, 256, 768, 1536)
# One step per prompt whatever the step budget: the simulation cuts prompts into steps itself.
WHOLE_PROMPT_STEPS = max(PREFILL_LENS)
DECODE_BATCHES = (1, 4, 8, 16, 32)
DECODE_CONTEXTS = (64, 512)
# Images per timed encode call, after a one-image warm-up (a 512-px tile: 2-6 s on a core).
ENCODE_CALLS = (2,)
ENCODE_IMAGE_SIZE = (448, 448)
PROCESSOR_FIELDS = ("longest_edge", "max_image_size", "image_seq_len", "do_resize", "do_image_splitting")
# Greedy, as bench and compare send: sampling at temperature 1 adds ~1.8 ms a sequence a step.
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# The TP worker timed: ranks, and each rank's KV budget (MiB; 32 sequences of 1,024 tokens fit).
TP_SIZE = 2
TP_KV_MB = 768
# Indicative USD per CPU core-hour, to rank candidates by cost like GPUs.
CPU_CORE_PRICE_PER_HOUR = 0.04


def default_path(model: str | None) -> Path:
    """The default VLM shares the default text model's: its language model is that model,
    and that calibration times its vision tower too."""
    return CACHE_DIR / f"{resolve_model(None if model == DEFAULT_VLM else model).name}-cpu.json"


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(100, vocab - 1, size=n).tolist()


def _prefill_steps(model_dir: str, reps: int, rng, prefix: list[int], engine: LLMEngine | None = None) -> list[dict]:
    """Prompts start with ``prefix``, so after the first each step computes the rest over
    cached blocks, as served prefills do."""
    engine = engine or LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=256,
                                                         max_num_batched_tokens=WHOLE_PROMPT_STEPS))
    vocab = engine.model.config.vocab_size
    out = []
    for n in PREFILL_LENS:
        for rep in range(reps + 1):
            engine.add_request(f"p{n}-{rep}", (prefix + _prompt(rng, n, vocab))[:n],
                               SamplingParams(max_tokens=1, **GREEDY))
            start = time.perf_counter()
            hit = engine.step()[0].num_cached_tokens
            ms = (time.perf_counter() - start) * 1e3
            if rep:  # the first of each length warms caches and allocator
                out.append({"prefill": [[n - hit, hit]], "num_decode": 0, "decode_context": 0, "ms": ms})
    return out


def _decode_steps(model_dir: str, steps: int, rng, given: LLMEngine | None = None) -> list[dict]:
    """Contexts all equal, or spread 32-1,024 (the padded gather costs by the longest)."""
    out = []
    for batch in DECODE_BATCHES:
        shapes = [[ctx] * batch for ctx in DECODE_CONTEXTS] + [np.linspace(32, 1024, batch).astype(int).tolist()]
        for contexts in shapes:
            engine = given or LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=512))
            vocab = engine.model.config.vocab_size
            ids = [f"d{len(out)}-{i}" for i in range(len(contexts))]
            for rid, ctx in zip(ids, contexts):
                kv = torch.zeros(engine.kv_block_shape(engine.pool.blocks_for(ctx)), dtype=engine.kv_cache.dtype)
                engine.add_request(rid, _prompt(rng, ctx, vocab),
                                   SamplingParams(max_tokens=steps + 2, **GREEDY), TensorKV(kv), first_token=42)
            engine.step()  # imports the KV
            for i in range(steps):
                start = time.perf_counter()
                engine.step()
                ms = (time.perf_counter() - start) * 1e3
                out.append({"prefill": [], "num_decode": batch, "decode_context": sum(contexts) + batch * (1 + i),
                            "decode_max_context": max(contexts) + 1 + i, "ms": ms})
            for rid in ids:
                engine.abort(rid)
    return out


def _encode_ms_per_tile(model_dir: str) -> tuple[float, list[dict]]:
    """(ms per tile, samples), embedding cache off, preprocessing included."""
    engine = EncodeEngine(model_dir, cache_bytes=0)
    w, h = ENCODE_IMAGE_SIZE
    rows, cols = engine.processor.grid((w, h))
    samples, seeds = [], iter(range(1000))
    for rep, n in enumerate((1, *ENCODE_CALLS)):
        images = [ImageInput.from_bytes(image_bytes(w, h, next(seeds)), "calibration") for _ in range(n)]
        start = time.perf_counter()
        engine.encode(images)
        if rep:  # the first warms caches and allocator
            samples.append({"images": n, "tiles": n * (rows * cols + 1), "ms": (time.perf_counter() - start) * 1e3})
    return sum(x["ms"] for x in samples) / sum(x["tiles"] for x in samples), samples


def _vision_dir(info) -> Path | None:
    """The model itself, or for the default text model the default VLM; else None."""
    if info.multimodal:
        return info.path
    return resolve_model(DEFAULT_VLM).path if info.name == resolve_model(None).name else None


def _fit(samples: list[dict]) -> tuple[LinearStep, float]:
    steps = [([tuple(c) for c in s["prefill"]], s["num_decode"], s["decode_context"],
              s.get("decode_max_context", 0)) for s in samples]
    ms = [s["ms"] for s in samples]
    model = LinearStep.fit(steps, ms)
    errors = [abs(model.step_ms(*step) - y) / y for step, y in zip(steps, ms)]
    return model, float(np.mean(errors))


def _handoff_ms(model_dir: str, sizes: tuple[int, ...] = (16, 512)) -> Link:
    """In-process shm hand-offs of ``sizes``-token prompts, as a same-host prefill worker
    makes them: bandwidth from the difference, latency from the smallest."""
    ctx = zmq.Context()
    prefill, pool = new_engine(model_dir, EngineConfig(kv_cache_memory_mb=256), True)
    decode = LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=256))
    exporter = handoff.Exporter(prefill, 60.0, ctx, None, "none", pool)
    importer = handoff.Importer(ctx, "shm", 10.0)
    rng = np.random.default_rng(0)
    points = []
    try:
        for i, n in enumerate((sizes[0], *sizes)):  # the first maps the pool: not timed
            prompt = _prompt(rng, n, prefill.model.config.vocab_size)
            _, t = loopback.generate_pd(prefill, decode, exporter, importer, f"h{i}", prompt,
                                        SamplingParams(max_tokens=2, ignore_eos=True))
            points.append((t.kv_bytes, sum(v for k, v in t.measured().items() if k.startswith("kv_") and k.endswith("_ms"))))
    finally:
        exporter.close()
        ctx.destroy(linger=0)
    (b0, ms0), (b1, ms1) = points[1], points[-1]
    gbs = (b1 - b0) / max(ms1 - ms0, 1e-3) / 1e6
    return Link(gbs=gbs, latency_ms=max(ms0 - b0 / (gbs * 1e6), 0.0))


def _median_rounds(rounds: list[list[dict]]) -> tuple[list[dict], float]:
    """(samples at their median ms, the rounds' own fits' mean (max - min) / median)."""
    samples = [dict(s, ms=float(np.median([r[i]["ms"] for r in rounds]))) for i, s in enumerate(rounds[0])]
    fits = [_fit(r)[0] for r in rounds]
    spreads = []
    for s in samples:
        step = ([tuple(c) for c in s["prefill"]], s["num_decode"], s["decode_context"], s.get("decode_max_context", 0))
        ms = [f.step_ms(*step) for f in fits]
        spreads.append((max(ms) - min(ms)) / np.median(ms))
    return samples, float(np.mean(spreads))


def calibrate(model: str | None = None, reps: int = 2, decode_steps: int = 4,
              seed: int = 0, rounds: int = 3, progress: bool = True) -> dict:
    """The calibration dict. Each step is fitted on its median over ``rounds`` rounds: a busy
    minute moves one round, not the fit (one round moved a 2-core fit ~20 %).

    Raises ModelLoadError, RuntimeError (fewer than 2 usable cores), ValueError (``rounds`` < 1)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: must be at least 1")
    info = resolve_model(model)
    vision_dir = _vision_dir(info)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("calibration needs 2 usable cores (workers of 1 and 2 cores)")
    template, prefix = _template_tokens(info.path)
    bar = tqdm(total=2 * rounds * (1 + (vision_dir is not None)) + rounds, desc="calibrate", unit="round",
               disable=not progress)
    fit_steps = partial(_fit_steps, rounds=rounds, reps=reps, decode_steps=decode_steps,
                        rng=np.random.default_rng(seed), prefix=prefix, bar=bar)
    try:
        fits, vlm_fits, encode, tp_fits, link = _measure(info.path, vision_dir, cores, fit_steps)
    finally:
        bar.close()
    kv_bpt = ModelSpec.from_dir(info.name, info.path, info.multimodal).kv_bytes_per_token(4)  # float32 KV on the wire
    cal = {"model": info.name, "machine": f"{host.processor() or host.machine()} ({len(cores)} cores)",
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "steps": fits, "tp_steps": tp_fits, "kv_link": {"gbs": link.gbs, "latency_ms": link.latency_ms},
           "kv_bytes_per_token": kv_bpt, "template_tokens": template,
           "template_prefix_tokens": len(prefix), "validations": {}}
    if vision_dir is not None:
        cal["vision"] = _vision_section(info.name, vision_dir, vlm_fits, encode)
    return cal


def _template_tokens(model_dir: Path) -> tuple[int, list[int]]:
    """(template tokens around an empty message, the tokens every chat prompt starts with)."""
    tokenizer = load_tokenizer(model_dir)
    template = len(chat_prompt_ids(tokenizer, [{"role": "user", "content": ""}]))
    a, b = (chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in ("yes", "no"))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return template, a[:prefix]


def _fit_steps(model_dir: Path, rounds: int, reps: int, decode_steps: int, rng, prefix: list[int], bar,
               engine: LLMEngine | None = None) -> dict:
    timed = []
    for _ in range(rounds):
        timed.append(_prefill_steps(str(model_dir), reps, rng, prefix, engine)
                     + _decode_steps(str(model_dir), decode_steps, rng, engine))
        bar.update(1)
    samples, spread = _median_rounds(timed)
    step, err = _fit(samples)
    return {"coef": list(step.coef), "mean_abs_rel_error": err, "rounds": rounds, "round_spread": spread,
            "samples": samples}


def _measure(model_dir: Path, vision_dir: Path | None, cores: list[int],
             fit_steps: Callable[..., dict]) -> tuple[dict, dict, dict, dict, Link]:
    """(fits, VLM fits, encode timings, TP fits, hand-off link); cores and threads restored."""
    saved_threads = torch.get_num_threads()
    fits, vlm_fits, encode = {}, {}, {}
    try:
        for size in (1, 2):
            os.sched_setaffinity(0, cores[:size])
            torch.set_num_threads(size)
            fits[str(size)] = fit_steps(model_dir)
            if vision_dir is not None:
                # Loaded dense (the quantized kernels need a GGUF): its steps are its own.
                vlm_fits[str(size)] = fit_steps(vision_dir)
                ms, calls = _encode_ms_per_tile(str(vision_dir))
                encode[str(size)] = {"ms_per_tile": ms, "samples": calls}
        os.sched_setaffinity(0, cores[:1])
        torch.set_num_threads(1)
        tp_fits = {str(TP_SIZE): _tp_fit(model_dir, cores, fit_steps)}
        link = _handoff_ms(str(model_dir))
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(saved_threads)
    return fits, vlm_fits, encode, tp_fits, link


def _tp_fit(model_dir: Path, cores: list[int], fit_steps: Callable[..., dict]) -> dict:
    """As serve runs a TP worker here (float32, a core and thread a rank); this process is rank 0."""
    ranks = Ranks.start(TP_SIZE, f"calibrate-tp{TP_SIZE}", str(model_dir), "float32", "f32", "cpu",
                        [[c] for c in cores[:TP_SIZE]])
    try:
        engine = LLMEngine(str(model_dir), EngineConfig(kv_cache_memory_mb=TP_KV_MB, weight_format="f32",
                                                        dtype="float32", max_num_batched_tokens=WHOLE_PROMPT_STEPS),
                           tp=ranks)
        return fit_steps(model_dir, engine=engine)
    finally:
        ranks.close()


def _vision_section(name: str, vision_dir: Path, vlm_fits: dict, encode: dict) -> dict:
    spec = ModelSpec.from_dir(name, vision_dir, True)
    p = spec.processor
    return {"model": str(vision_dir), "steps": vlm_fits, "encode": encode, "hidden_size": spec.hidden_size,
            "dtype_bytes": 4,  # float32 embeddings, as encode workers send them by default
            "processor": {k: getattr(p, k) for k in PROCESSOR_FIELDS}}


def save(cal: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal, indent=1))
    return path


def load(path: str | Path) -> dict:
    """Raises ValueError for a missing file or one that is not a usable calibration."""
    path = Path(path)
    try:
        cal = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no calibration at {path}; run `epdserve plan calibrate` first") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(cal, dict) or not {"steps", "kv_link", "kv_bytes_per_token"} <= set(cal):
        raise ValueError(f"{path}: not an epdserve calibration file")
    try:
        fits = [*cal["steps"].values(), *cal.get("tp_steps", {}).values()]
        if any(len(fit["coef"]) != len(FEATURES) for fit in fits):
            raise ValueError("made by an older epdserve (other cost-model features); run `epdserve plan "
                             "calibrate` again")
        platform_from(cal)
        if cal.get("vision", {}).get("steps"):
            platform_from(cal, vlm=True)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"{path}: not a usable epdserve calibration ({type(exc).__name__}: {exc})") from None
    return cal


def platform_from(cal: dict, router_ms: float = 3.0, vlm: bool = False) -> Platform:
    """Workers of 1 or 2 cores with the fitted steps (``vlm``: the VLM's language model's,
    and its encode per tile), KV over the measured hand-off, the fitted serving slowdowns (1 when
    not fitted), and each worker's KV as serve sizes it (``--kv-cache-memory-mb``, float32).

    Raises ValueError: ``vlm`` without VLM fits, or a negative coefficient or serving factor."""
    fitted = cal.get("vision", {}).get("steps") if vlm else cal["steps"]
    if not fitted:
        raise ValueError("this calibration has no step fits of the vision-language model's language "
                         "model (made before they were taken): rerun `epdserve plan calibrate`")
    steps = {int(k): LinearStep(tuple(float(c) for c in v["coef"])) for k, v in fitted.items()}
    serving = {k: float(cal.get("serving", {}).get(k, 1.0)) for k in ("decode_slowdown", "contended_slowdown")}
    prefill_slowdown = {int(k): float(v) for k, v in cal.get("serving", {}).get("prefill_slowdown", {}).items()}
    tp_steps = tp_step_models(cal, vlm)
    if any(c < 0 for fit in [*steps.values(), *tp_steps.values()] for c in fit.coef) \
            or min([*serving.values(), *prefill_slowdown.values()]) <= 0:
        raise ValueError("negative step coefficients or serving factors")

    def step(devices: int) -> LinearStep:
        if devices not in steps:
            raise ValueError(f"no calibration for a worker of {devices} cores (have {sorted(steps)})")
        return steps[devices]

    images, name = None, cal["model"]
    if vlm:
        vision = cal["vision"]
        name = Path(vision["model"]).name
        per_tile = {int(k): v["ms_per_tile"] for k, v in vision["encode"].items()}
        processor = ImageProcessor(**vision["processor"])
        images = ImageCost(processor, lambda tiles, devices: tiles * per_tile[devices],
                           vision["hidden_size"], vision["dtype_bytes"])

    kv_capacity = EngineConfig.kv_cache_memory_mb * 2**20 // cal["kv_bytes_per_token"]
    return Platform(name=f"{name} on this CPU", step=step, worker_sizes=tuple(sorted(steps)),
                    kv_bytes_per_token=cal["kv_bytes_per_token"], kv_link=Link(**cal["kv_link"]),
                    price_per_device_hour=CPU_CORE_PRICE_PER_HOUR, router_ms=router_ms, **serving,
                    prefill_slowdown=prefill_slowdown,
                    step_uncertainty=step_uncertainty(cal.get("serving", {})),
                    template_tokens=cal.get("template_tokens", 0),
                    template_prefix_tokens=cal.get("template_prefix_tokens", 0),
                    error=list(cal.get("validations", {}).values()) or None,
                    images=images, kv_capacity_tokens=lambda devices: kv_capacity,
                    tp_step=partial(_tp_step, tp_steps, vlm))


def _tp_step(tp_steps: dict[int, LinearStep], vlm: bool, ranks: int) -> LinearStep:
    """Raises NoStepModel, saying why and what to run."""
    if ranks in tp_steps:
        return tp_steps[ranks]
    if vlm:
        raise NoStepModel("this calibration has no step fit of a tensor-parallel worker of the vision-language "
                          "model's language model (only the text model's are timed)")
    if tp_steps:
        raise NoStepModel(f"this calibration has no step fit of a tensor-parallel worker of {ranks} ranks "
                          f"(have {sorted(tp_steps)})")
    raise NoStepModel(f"this calibration has no step fit of a tensor-parallel worker ({ranks} ranks): made "
                      f"before they were timed; rerun `epdserve plan calibrate`")


def tp_step_models(cal: dict, vlm: bool = False) -> dict[int, LinearStep]:
    """``tp_steps`` fits by ranks; none for older calibrations or ``vlm``."""
    if vlm:
        return {}
    return {int(k): LinearStep(tuple(float(c) for c in v["coef"])) for k, v in cal.get("tp_steps", {}).items()}
