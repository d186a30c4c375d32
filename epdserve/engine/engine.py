"""The engine loop of one worker: requests in, one scheduled forward pass per step, tokens out.

The engine knows no worker roles; each request says what it needs (the serving layer's
roles are built from these, see docs/architecture.md):

* by default it is prefilled and decoded here;
* ``hold_kv``: it stops after the first token and its prompt's KV blocks stay held for
  the caller (the output's ``kv_block_ids``) until :meth:`LLMEngine.release_kv`; with a
  ``layer_sink`` the prefill step also hands each layer's K/V to it as soon as it is
  computed (a layer-pipelined export);
* with a ``kv`` source (:class:`~epdserve.engine.kv_source.KVSource`) and its first token,
  the prompt's KV is imported instead of computed, and it generates the rest.

The engine is synchronous and single-threaded; the worker process around it does the I/O.
"""

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
    """A paged-KV engine over one :class:`~epdserve.model.llama.LlamaModel`.

    ``tp``: this engine is rank 0 of a tensor-parallel group (``model/tensor_parallel.py``'s
    :class:`RankDriver`): it loads rank 0's shard, sizes the KV pool by that shard's KV
    bytes (every rank gets the same block count) and calls the model ``tp.drive`` returns,
    which runs every forward pass on all the ranks; decode steps run eagerly (no CUDA graphs).
    ``kv_parts`` holds every rank's cache where this process can address them (imports and
    exports move every KV head; ``kv_cache`` is rank 0's part).

    Raises (constructor): ``ValueError`` for an unknown dtype, a weight format or KV cache
    dtype the model cannot hold, a device that is not one or is not here (``parse_device``),
    a budget too small for one block, or a ``kv_allocator`` whose tensor does not fit the
    cache (or with ``tp``, any); ``ModelLoadError`` for a model that cannot be loaded; with
    ``tp``, whatever ``tp.drive`` raises (another rank failed to start).
    """

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
        self.kv_cache = parts[0]  # what this process's forward pass reads and writes
        # Every rank's part, for imports and exports (None where the other ranks' caches are not addressable here).
        self.kv_parts = KVParts(parts) if len(parts) == len(self.model.kv_head_split) else None
        self.graphs = None  # captured before any request holds a block: the capture's warm-up writes slot 0
        if not config.enforce_eager and self.device.type == "cuda" and tp is None:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
                                       -(-self.max_model_len // config.block_size))
            self.graphs.capture()
        self.tuned = dict(self.model.tuned)  # the choices measured on this machine (model/tuning.py), by name
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=self._step_budget(config, tp is not None),
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching), self.pool)
        self.seqs: dict[str, Sequence] = {}
        # The prompt blocks of requests that asked to hold their KV, until release_kv.
        self.held: dict[str, list[int]] = {}
        # Structured output (engine/guided.py), made at the first guided request.
        self.guided = None
        self.prompt_logprobs = PromptLogprobsCollector(self.model.logits)
        # Forward passes run, and the tokens the last one computed (vLLM's iteration_tokens_total).
        self.num_steps = self.last_step_tokens = 0

    def _step_budget(self, config: EngineConfig, ranks: bool) -> int:
        """``config.max_num_batched_tokens``; unset, the context window without chunked prefill,
        else what this machine prefills in half a second (``model/step_budget.py``, in
        ``tuned``) on the CPU, vLLM's 2,048 on a GPU or with tensor-parallel ranks."""
        if config.max_num_batched_tokens or not config.enable_chunked_prefill:
            return config.max_num_batched_tokens or self.max_model_len
        if self.device.type != "cpu" or ranks:
            return SchedulerConfig.max_num_batched_tokens
        self.tuned["max_num_batched_tokens"] = step_budget.measured(self.model, self.kv_dtype)
        return self.tuned["max_num_batched_tokens"].value

    def kv_layout(self) -> dict:
        """What a peer must match to exchange KV blocks with this engine (every KV head of
        the model, whatever the ranks it is split over)."""
        mc = self.model.config
        return {"num_layers": mc.num_hidden_layers, "num_kv_heads": sum(self.model.kv_head_split),
                "head_dim": mc.head_dim, "block_size": self.config.block_size,
                "dtype": kv_cache_dtype.name_of(self.kv_dtype)}

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    kv: KVSource | None = None, first_token: int | None = None,
                    timings: StageTimings | None = None, arrival: float | None = None,
                    images: list[tuple[str, int]] = (), image_embeddings: torch.Tensor | None = None,
                    hold_kv: bool = False, layer_sink: LayerSink | None = None) -> None:
        """Queue a request. It may bring ``kv`` (the prompt's KV blocks ``[layers, 2,
        n_blocks, block_size, kv_heads, head_dim]``, from any :class:`KVSource`) and
        ``first_token``, or neither, and then prefills the prompt itself. ``hold_kv``: stop
        after the first token and hold the prompt's blocks (see :class:`StepOutput`'s
        ``kv_block_ids``); ``layer_sink``: gets each layer of the prompt's K/V during the
        step that completes the prompt (see :class:`~epdserve.engine.kv_source.LayerSink`).
        ``timings`` (e.g. the KV fetch's) are reported with the request's own;
        ``arrival`` is the ``time.perf_counter()`` at which the request reached the worker
        (default: now), the start of its ``queue_ms``. ``images``: ``(content hash,
        <image> tokens)`` of each image of the prompt, in order, with
        ``image_embeddings [sum of tokens, hidden]`` (needed unless ``kv`` comes too).

        Raises:
            ValueError: duplicate id, empty or out-of-vocabulary prompt, a stop token id or
                ``logit_bias`` token outside the vocabulary, prompt plus ``max_tokens`` over the
                context window, the KV pool or (unchunked) a step's budget, KV of the wrong shape
                or dtype, images for a text model, images whose tokens or embeddings do not match
                the prompt, images without embeddings to prefill, prompt logprobs over
                ``MAX_PROMPT_LOGPROB_ENTRIES``, or a ``guided`` grammar that does not compile or
                that ``first_token`` breaks (``GuidedError``).
        """
        if request_id in self.seqs or request_id in self.held:
            raise ValueError(f"duplicate request id {request_id!r}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        self._check_vocabulary(prompt_token_ids, sampling)
        self._check_length(n, sampling.max_tokens)
        if (kv is None) != (first_token is None):
            raise ValueError("kv and first_token come together or not at all")
        seq = Sequence(request_id, prompt_token_ids, sampling, kv, first_token,
                       self._prompt_images(prompt_token_ids, images, image_embeddings, kv is not None))
        seq.hold_kv, seq.layer_sink = hold_kv, layer_sink
        seq.guided = self._guided_matcher(sampling, first_token)
        if sampling.prompt_logprobs is not None and kv is None:  # an imported prompt was scored where it was computed
            self.prompt_logprobs.start(request_id, n, sampling.prompt_logprobs)
        if timings is not None:
            seq.timings.update(timings)
        if arrival is not None:
            seq.arrival = arrival
        if kv is not None:
            kv.validate(self.kv_block_shape(self.pool.blocks_for(n)), self.kv_cache.dtype)
            seq.num_computed_tokens = seq.max_computed_tokens = n  # the prompt's K/V arrives with the request
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_length(self, n: int, max_tokens: int) -> None:
        """Raises ValueError for a request too long to run (see :meth:`add_request`)."""
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
        """Raises ValueError for a prompt, stop or ``logit_bias`` token outside the vocabulary."""
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
        """This engine's :class:`~epdserve.engine.guided.GuidedDecoder` (grammar compiler
        and cache), made at first use. Not thread-safe against itself: a worker calls it
        from one thread, where it compiles requests' grammars off its loop before queueing
        them here (``add_request`` then finds them compiled)."""
        if self.guided is None:
            # Imported at the first guided request: xgrammar brings transformers (~2 s of
            # start-up, ~100 MB) that a worker serving none does not need.
            from epdserve.engine import guided

            mc = self.model.config
            self.guided = guided.GuidedDecoder(load_tokenizer(self.model_dir), mc.vocab_size, mc.eos_token_ids)
        return self.guided

    def _guided_matcher(self, sampling: SamplingParams, first_token: int | None):
        """A guided request's grammar matcher (None for another), advanced over
        ``first_token`` when the request comes with it (the prefill worker sampled it under
        the same grammar).

        Raises:
            GuidedError: (a ValueError) the grammar does not compile, or ``first_token`` breaks it.
        """
        if sampling.guided is None:
            return None
        return self.guided_decoder().matcher(sampling.guided, [] if first_token is None else [first_token])

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
        """Stop a request and free its blocks (and any held ones). True if it existed."""
        found = self.release_kv(request_id)
        self.prompt_logprobs.take(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        return found or seq is not None

    def release_kv(self, request_id: str) -> bool:
        """End the hold of a ``hold_kv`` request: free its prompt's blocks (once they have
        been copied out, or will not be). True if it held any."""
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)
        return blocks is not None

    def read_kv(self, block_ids: list[int], out: torch.Tensor | None = None,
                layer: int | None = None) -> torch.Tensor:
        """Copy blocks out of the cache into ``out [layers, 2, len(block_ids), block_size,
        kv_heads, head_dim]`` (any float dtype, any device: a frame in host memory; allocated
        on the host in the cache's dtype when None) and return it; with ``layer``, only that
        layer's: ``out [2, len(block_ids), ...]``. From a CUDA cache into host memory this
        is the device-to-host staging of a hand-off; the copies are synchronous, so ``out``
        holds the blocks when it returns."""
        cache = self._parts() if layer is None else self._parts().layer(layer)
        if out is None:
            out = torch.empty(self.kv_block_shape(len(block_ids))[layer is not None:], dtype=self.kv_cache.dtype)
        # One strided copy per run of consecutive blocks and part: faster than index_select,
        # whose threaded path stalls for seconds on a busy machine.
        copy_blocks(cache, block_ids, KVParts([out if layer is None else out[None]]), list(range(len(block_ids))))
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Block and queue counts (what a worker reports to the router). ``blocks_in_use``
        counts referenced blocks (cached-but-free ones are not in use); the prefix-cache counters
        are cumulative tokens (:class:`~epdserve.engine.prefix_cache.PrefixCache`); ``num_steps``
        counts forward passes, ``last_step_tokens`` the tokens the last one computed."""
        return {"blocks_total": self.pool.num_blocks, "blocks_in_use": self.pool.num_in_use,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "prefix_cache_queries": self.scheduler.prefix_cache.queries,
                "prefix_cache_hits": self.scheduler.prefix_cache.hits,
                "num_steps": self.num_steps, "last_step_tokens": self.last_step_tokens}

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward pass, sample, and return the new tokens.

        A request whose KV import or sampling fails ends with an "error" output and
        leaves the engine; the others go on. Raises whatever the forward pass raises
        (a failure there cannot be put down to one request)."""
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
                except Exception as exc:  # this request's KV is void (e.g. its hand-off expired)
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
            # One request's row broke the batch's sampling (sample() leaves ``logits``
            # as it was): sample each row alone, and fail only the rows that still fail.
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
            return failed + [self._sample_alone(logits[i:i + 1], seq, eos) for i, seq in enumerate(seqs)]
        return failed + [self._append(seq, token, lp) for seq, token, lp in zip(seqs, tokens, logprobs)]

    def _layer_writer(self, batch) -> Callable[[int], None] | None:
        """What the forward pass calls once each layer's K/V is written: every layer sink of
        a request whose prompt this step completes gets that layer of the prompt's blocks
        (one call per sink and layer, with all of its prompts). None: no such request."""
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
        """``seq``'s output of this step from its ``logits [1, vocab]``, or an error output
        (and ``seq`` leaves the engine, its blocks freed) if its sampling fails."""
        try:
            (token,), (lp,) = sample(logits, [seq], eos)
        except Exception:
            log.exception("request %s: sampling failed", seq.request_id)
            return self._fail(seq, "sampling the next token failed for this request")
        return self._append(seq, token, lp)

    def _fail(self, seq: Sequence, message: str, batch=None) -> StepOutput:
        """Take ``seq`` out of the engine, its blocks freed (and out of this step's
        ``batch`` if given); its output carries ``message``."""
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
        # kv_import_ms is the copy alone: the source (and a /dev/shm mapping or TCP buffer
        # it holds) is freed on return, which takes 3-17 ms for a 24-94 MB frame on this
        # machine (benchmarks/kv_handoff.py sizes) and shows in a trace in first_decode_ms.

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        if seq.guided is not None and not seq.guided.accept_token(token):
            # Only when the masks left no token (e.g. the grammar allows only EOS and
            # min_tokens masks it): the argmax then picks a refused one.
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
            # Keep the prompt's blocks (not the first token's, which has no K/V yet) until
            # the caller releases them.
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
        """``queue_ms`` (arrival at the worker to first scheduled, less a KV fetch made in
        between), ``prefill_ms`` (first scheduled to first token; not for a request that
        imported its KV) and ``decode_ms`` (to the last token, not for one that holds its
        KV; for an import from first scheduled, so it includes ``kv_import_ms`` and
        ``first_decode_ms``: its first step here, to the first token sampled, less the
        import), and
        ``recomputed_tokens`` (tokens computed again after a preemption; 0 if none), plus
        ``seq.timings``; times in ms."""
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

