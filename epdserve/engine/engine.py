"""The engine loop of one worker: requests in, one forward pass per step, tokens out. A request may
``hold_kv`` (its prompt's blocks held until :meth:`LLMEngine.release_kv`, each layer's K/V handed to a
``layer_sink`` as computed) or bring a ``kv`` source and first token. Synchronous, single-threaded."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from epdserve.engine import runner
from epdserve.engine.block_pool import BlockPool
from epdserve.engine.config import DTYPES, EngineConfig, default_dtype
from epdserve.engine.kv_parts import KVParts, copy_blocks
from epdserve.engine.kv_source import KVSource, LayerSink
from epdserve.engine.outputs import StepOutput
from epdserve.engine.prompt_logprobs import PromptLogprobsCollector
from epdserve.engine.request import PromptImages, SamplingParams, Sequence
from epdserve.engine.sampler import TokenLogprobs, sample
from epdserve.engine.scheduler import Scheduler, SchedulerConfig
from epdserve.model import kv_cache_dtype, step_budget
from epdserve.model.cuda_graphs import DecodeGraphs
from epdserve.model.device import parse_device, synchronize
from epdserve.model.loader import load_language_model
from epdserve.model.tensor_parallel import RankDriver
from epdserve.model.tokenizer import load_tokenizer
from epdserve.trace import StageTimings

log = logging.getLogger(__name__)

class LLMEngine:
    """A paged-KV engine over one :class:`~epdserve.model.llama.LlamaModel`. ``tp``: rank 0 of a
    tensor-parallel group (same block count on every rank, eager decode; ``kv_parts``: every rank's cache
    where addressable). Raises ValueError (bad dtype, weight format, KV dtype, device, budget or
    ``kv_allocator``), ModelLoadError, and with ``tp`` whatever ``tp.drive`` raises."""

    def __init__(self, model_dir: str, config: EngineConfig = EngineConfig(), kv_allocator=None,
                 tp: RankDriver | None = None):
        dtype = config.dtype or default_dtype(config.device)
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.dtype!r} (choose from {', '.join(DTYPES)})")
        self.config = config
        self.model_dir = model_dir
        device = parse_device(config.device)
        self.device = torch.device(device)
        self.model, self.image_token_id = load_language_model(model_dir, DTYPES[dtype], config.weight_format,
                                                              device, tp.rank if tp else None)
        mc = self.model.config
        self.max_model_len = mc.max_position_embeddings
        self.kv_dtype = kv_cache_dtype.resolve(config.kv_cache_dtype, self.model.dtype, device)
        block_bytes = config.block_size * mc.kv_bytes_per_token(self.kv_dtype.itemsize)
        num_blocks = config.num_kv_blocks or config.kv_cache_memory_mb * 2**20 // block_bytes
        self.pool = BlockPool(num_blocks, config.block_size)
        if tp is None:  # kv_allocator(shape, dtype, device): a prefill worker's shared KV pool (/dev/shm or CUDA IPC)
            parts = [self.model.allocate_kv_cache(num_blocks, config.block_size, kv_allocator, self.kv_dtype)]
        elif kv_allocator is not None:
            raise ValueError("a tensor-parallel engine's KV cache is its ranks' (tp.drive), not a kv_allocator's")
        else:
            self.model, parts = tp.drive(self.model, num_blocks, config.block_size, self.kv_dtype)
        self.kv_cache = parts[0]
        self.kv_parts = KVParts(parts) if len(parts) == len(self.model.kv_head_split) else None
        self.graphs = None  # captured before any request holds a block: the capture's warm-up writes slot 0
        if not config.enforce_eager and self.device.type == "cuda" and tp is None:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
                                       -(-self.max_model_len // config.block_size))
            self.graphs.capture()
        self.tuned = dict(self.model.tuned)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=self._step_budget(config, tp is not None),
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching), self.pool)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, list[int]] = {}
        self.guided = None
        self.prompt_logprobs = PromptLogprobsCollector(self.model.logits)
        # Forward passes run, and the tokens the last one computed (vLLM's iteration_tokens_total).
        self.num_steps = self.last_step_tokens = 0

    def _step_budget(self, config: EngineConfig, ranks: bool) -> int:
        """Unset: the context window unchunked, else what the CPU prefills in 0.5 s, or vLLM's 2,048 (GPU, ranks)."""
        if config.max_num_batched_tokens or not config.enable_chunked_prefill:
            return config.max_num_batched_tokens or self.max_model_len
        if self.device.type != "cpu" or ranks:
            return SchedulerConfig.max_num_batched_tokens
        self.tuned["max_num_batched_tokens"] = step_budget.measured(self.model, self.kv_dtype)
        return self.tuned["max_num_batched_tokens"].value

    def kv_layout(self) -> dict:
        """What a peer must match to exchange KV blocks (every KV head, whatever the ranks)."""
        mc = self.model.config
        return {"num_layers": mc.num_hidden_layers, "num_kv_heads": sum(self.model.kv_head_split),
                "head_dim": mc.head_dim, "block_size": self.config.block_size,
                "dtype": kv_cache_dtype.name_of(self.kv_dtype)}

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    kv: KVSource | None = None, first_token: int | None = None,
                    timings: StageTimings | None = None, arrival: float | None = None,
                    images: list[tuple[str, int]] = (), image_embeddings: torch.Tensor | None = None,
                    hold_kv: bool = False, layer_sink: LayerSink | None = None,
                    resume_ids: list[int] = ()) -> None:
        """``kv``: the prompt's KV ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]``, with ``first_token``.
        ``arrival``: ``time.perf_counter()`` at the worker (default now). ``images``: ``(content hash, <image>
        tokens)`` each, with ``image_embeddings [sum of tokens, hidden]`` unless ``kv`` comes too.
        ``resume_ids``: a migrated request's output so far (``Sequence``), without ``kv``.

        Raises ValueError for a request that cannot run here (duplicate id, tokens outside the vocabulary, too
        long for the window, the pool or an unchunked step, mismatched KV or images, too many prompt logprobs,
        max_tokens already reached) and GuidedError (a ValueError) for a grammar that fails to compile or that
        ``first_token`` or ``resume_ids`` break."""
        if request_id in self.seqs or request_id in self.held:
            raise ValueError(f"duplicate request id {request_id!r}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        self._check_vocabulary([*prompt_token_ids, *resume_ids], sampling)
        self._check_length(n, sampling.max_tokens)
        if (kv is None) != (first_token is None):
            raise ValueError("kv and first_token come together or not at all")
        if resume_ids and (kv is not None or len(resume_ids) >= sampling.max_tokens):
            raise ValueError(f"resume_ids ({len(resume_ids)} tokens) come without kv and under max_tokens "
                             f"({sampling.max_tokens})")
        seq = Sequence(request_id, prompt_token_ids, sampling, kv, first_token,
                       self._prompt_images(prompt_token_ids, images, image_embeddings, kv is not None), resume_ids)
        seq.hold_kv, seq.layer_sink = hold_kv, layer_sink
        seq.guided = self._guided_matcher(sampling, seq.token_ids[n:])
        if sampling.prompt_logprobs is not None and kv is None:  # an imported prompt was scored where it was computed
            self.prompt_logprobs.start(request_id, n, sampling.prompt_logprobs)
        if timings is not None:
            seq.timings.update(timings)
        if arrival is not None:
            seq.arrival = arrival
        if kv is not None:
            kv.validate(self.kv_block_shape(self.pool.blocks_for(n)), self.kv_cache.dtype)
            seq.num_computed_tokens = seq.max_computed_tokens = n
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_length(self, n: int, max_tokens: int) -> None:
        total = n + max_tokens
        what = f"prompt ({n} tokens) plus max_tokens ({max_tokens}) is {total} tokens"
        if total > self.max_model_len:
            raise ValueError(f"{what}, over the context window of {self.max_model_len}")
        budget = self.scheduler.config
        if total > budget.max_num_batched_tokens and not budget.enable_chunked_prefill:
            # A preempted request computes its prompt and generated tokens again in one step.
            raise ValueError(f"{what}, over the {budget.max_num_batched_tokens} tokens a step computes without "
                             "chunked prefill (--max-num-batched-tokens)")
        if self.pool.blocks_for(total) > self.pool.num_blocks:
            raise ValueError(f"request needs {self.pool.blocks_for(total)} KV blocks but the whole pool has "
                             f"{self.pool.num_blocks}")

    def _check_vocabulary(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        bad_stop = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise ValueError(f"stop_token_ids has {bad_stop}, outside the vocabulary [0, {vocab})")
        bad_bias = next((t for t in sampling.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias has token {bad_bias}, outside the vocabulary [0, {vocab})")

    def guided_decoder(self):
        """Made at first use. Not thread-safe: a worker calls it from one thread only."""
        if self.guided is None:
            # Lazy: xgrammar brings transformers (~2 s of start-up, ~100 MB).
            from epdserve.engine import guided

            mc = self.model.config
            self.guided = guided.GuidedDecoder(load_tokenizer(self.model_dir), mc.vocab_size, mc.eos_token_ids)
        return self.guided

    def _guided_matcher(self, sampling: SamplingParams, output_ids: list[int]):
        """None unless guided; advanced over the output made elsewhere. Raises GuidedError (a ValueError)."""
        if sampling.guided is None:
            return None
        return self.guided_decoder().matcher(sampling.guided, output_ids)

    def _prompt_images(self, prompt_token_ids: list[int], images: list[tuple[str, int]],
                       embeddings: torch.Tensor | None, has_kv: bool) -> PromptImages | None:
        if not images:
            return None
        if self.image_token_id is None:
            raise ValueError("this model takes no images (serve a vision-language model, e.g. --model vlm)")
        if embeddings is None and not has_kv:
            raise ValueError("a prompt with images needs their embeddings to be prefilled")
        return PromptImages(prompt_token_ids, self.image_token_id, list(images), embeddings,
                            self.model.config.hidden_size)

    def abort(self, request_id: str) -> bool:
        """Frees its blocks, held ones too. True if it existed."""
        found = self.release_kv(request_id)
        self.prompt_logprobs.take(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        return found or seq is not None

    def release_kv(self, request_id: str) -> bool:
        """Free a ``hold_kv`` request's prompt blocks. True if it held any."""
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)
        return blocks is not None

    def read_kv(self, block_ids: list[int], out: torch.Tensor | None = None,
                layer: int | None = None) -> torch.Tensor:
        """Copy blocks into ``out [layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` (any float dtype
        and device; None: host, the cache's dtype), or with ``layer`` ``out [2, len(block_ids), ...]``. Synchronous."""
        cache = self._parts() if layer is None else self._parts().layer(layer)
        if out is None:
            out = torch.empty(self.kv_block_shape(len(block_ids))[layer is not None:], dtype=self.kv_cache.dtype)
        # Strided copies per run of blocks: index_select's threaded path stalls for seconds when busy.
        copy_blocks(cache, block_ids, KVParts([out if layer is None else out[None]]), list(range(len(block_ids))))
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Counts reported to the router; the prefix-cache counters are cumulative tokens."""
        return {"blocks_total": self.pool.num_blocks, "blocks_in_use": self.pool.num_in_use,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.scheduler.prefix_cache.queries,
                "prefix_cache_hits": self.scheduler.prefix_cache.hits,
                "num_steps": self.num_steps, "last_step_tokens": self.last_step_tokens}

    def step(self) -> list[StepOutput]:
        """A request whose KV import or sampling fails gets an "error" output and leaves; the others go on."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.perf_counter()
        failed = []
        for seq in list(batch.seqs):
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            if seq.pending_kv is not None:
                try:
                    self._import_kv(seq)
                except Exception as exc:
                    failed.append(self._fail(seq, str(exc), batch))
        if not batch:
            return failed
        logits, sampled = runner.run(self.model, batch, self.kv_cache, self._layer_writer(batch),
                                     self.prompt_logprobs.sink(batch), self.graphs)
        self.num_steps, self.last_step_tokens = self.num_steps + 1, sum(batch.num_tokens)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            # Tokens under the mark had K/V here before a preemption dropped it: computed again.
            seq.num_recomputed_tokens += max(0, min(seq.num_computed_tokens + n, seq.max_computed_tokens)
                                             - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            seq.max_computed_tokens = max(seq.max_computed_tokens, seq.num_computed_tokens)
            self.scheduler.prefix_cache.register(seq)
        seqs = [batch.seqs[i] for i in sampled]
        eos = self.model.config.eos_token_ids
        try:
            tokens, logprobs = sample(logits, seqs, eos)
        except Exception:
            # sample() leaves ``logits`` intact: sample each row alone, failing only those that still fail.
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
            return failed + [self._sample_alone(logits[i:i + 1], seq, eos) for i, seq in enumerate(seqs)]
        return failed + [self._append(seq, token, lp) for seq, token, lp in zip(seqs, tokens, logprobs)]

    def _layer_writer(self, batch) -> Callable[[int], None] | None:
        """Called per layer once its K/V is written: feeds the layer sinks of prompts this step completes."""
        sinks: dict[int, tuple[LayerSink, list[tuple[str, list[int]]]]] = {}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            completes = seq.is_prefilling and seq.num_computed_tokens + n == seq.num_prompt_tokens
            if seq.layer_sink is not None and completes:
                prompt_blocks = seq.block_table[: self.pool.blocks_for(seq.num_prompt_tokens)]
                sinks.setdefault(id(seq.layer_sink), (seq.layer_sink, []))[1].append((seq.request_id, prompt_blocks))
        if not sinks:
            return None

        def kv_written(layer: int) -> None:
            for sink, prompts in sinks.values():
                sink.write_layer(layer, prompts)

        return kv_written

    def _sample_alone(self, logits: torch.Tensor, seq: Sequence, eos: tuple[int, ...]) -> StepOutput:
        try:
            (token,), (lp,) = sample(logits, [seq], eos)
        except Exception:
            log.exception("request %s: sampling failed", seq.request_id)
            return self._fail(seq, "sampling the next token failed for this request")
        return self._append(seq, token, lp)

    def _fail(self, seq: Sequence, message: str, batch=None) -> StepOutput:
        if batch is not None:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_tokens[i]
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]
        self.prompt_logprobs.take(seq.request_id)
        return StepOutput(seq.request_id, [], finished=True, finish_reason="error", error=message)

    def kv_block_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.kv_cache.shape  # (every KV head, on however many ranks)
        return (*c[:2], num_blocks, c[3], sum(self.model.kv_head_split), c[5])

    def _parts(self) -> KVParts:
        if self.kv_parts is None:
            raise RuntimeError("the KV of this engine's other tensor-parallel ranks is not addressable here")
        return self.kv_parts

    def _import_kv(self, seq: Sequence) -> None:
        # The leading blocks found in the prefix cache at admission already hold this K/V.
        start = time.perf_counter()
        kv, seq.pending_kv = seq.pending_kv, None
        kv.copy_into(self._parts(), seq.block_table, seq.num_cached_blocks)
        synchronize(*{p.device for p in self.kv_parts.parts})  # the copy's time; TP ranks' GPU parts done
        seq.timings.kv_import_ms = (time.perf_counter() - start) * 1e3
        # kv_import_ms excludes freeing the source (3-17 ms for 24-94 MB frames): that shows in first_decode_ms.

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        if seq.guided is not None and not seq.guided.accept_token(token):
            # Only when the masks left no token (e.g. the grammar allows only EOS and min_tokens masks it).
            return self._fail(seq, "no token satisfies both the request's grammar and its other settings")
        seq.token_ids.append(token)
        seq.num_output_tokens += 1
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.timings.kv_import_ms is not None:  # the step that imported its KV: all of it but the import
                seq.timings.first_decode_ms = (now - seq.first_scheduled) * 1e3 - seq.timings.kv_import_ms
        p = seq.sampling
        reason = None
        if (token in p.stop_token_ids or (not p.ignore_eos and token in self.model.config.eos_token_ids)
                or (seq.guided is not None and seq.guided.is_terminated())):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        out = StepOutput(seq.request_id, [token], finished=reason is not None, finish_reason=reason,
                         logprobs=None if logprobs is None else [logprobs],
                         prompt_logprobs=self.prompt_logprobs.take(seq.request_id))
        out.num_cached_tokens = seq.num_cached_tokens or 0
        if reason is None and seq.hold_kv:
            # Hold the prompt's blocks, not the first token's (no K/V yet).
            keep = self.pool.blocks_for(seq.num_prompt_tokens)
            out.kv_block_ids = seq.block_table[:keep]
            self.held[seq.request_id] = out.kv_block_ids
            self.pool.free(seq.block_table[keep:])
            seq.block_table = []
        if reason is not None or out.kv_block_ids is not None:
            self.scheduler.remove(seq)
            del self.seqs[seq.request_id]
            out.timings = self._timings(seq, now)
        return out

    def _timings(self, seq: Sequence, now: float) -> StageTimings:
        """Times in ms. ``queue_ms``: arrival to first scheduled, less a KV fetch; ``prefill_ms``: to the first
        token (not for a KV import); ``decode_ms``: to the last token (not for held KV; for an import, from first
        scheduled, so including ``kv_import_ms``)."""
        t = seq.timings.model_copy()
        t.recomputed_tokens = seq.num_recomputed_tokens
        t.queue_ms = (seq.first_scheduled - seq.arrival) * 1e3 - (t.kv_fetch_ms or 0.0)
        if t.kv_import_ms is not None:
            t.decode_ms = (now - seq.first_scheduled) * 1e3
        else:
            t.prefill_ms = (seq.first_token_time - seq.first_scheduled) * 1e3
            if not seq.hold_kv:
                t.decode_ms = (now - seq.first_token_time) * 1e3
        return t

