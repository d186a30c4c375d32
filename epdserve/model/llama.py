"""Llama-family decoder (llama, mistral, qwen2) over a paged KV cache, one forward pass per engine step;
the maths follows transformers' ``modeling_llama`` so that greedy tokens match it exactly."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from epdserve.model import kernels, layer_ops, linear, prefill_attention, quant, tensor_parallel, tuning
from epdserve.model.base import ModelLoadError
from epdserve.model.config import ModelConfig


@dataclass
class PrefillSeq:
    """One sequence with ``q_len`` new tokens at rows ``[start, start + q_len)`` of the
    batch; ``ctx_len`` positions (cached + new) are attended; ``block_table [n_blocks]``."""

    start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """``positions [T]``; ``slot_mapping [T]``: flat KV slot (block id × block_size + offset) of each new
    token; ``prefills``: sequences with more than one new token; ``decode_rows [B]``,
    ``decode_block_tables [B, max_blocks]`` (0-padded), ``decode_ctx_lens [B]``; ``logits_rows [S]``."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_ctx_lens: torch.Tensor
    logits_rows: torch.Tensor


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """``[head_dim / 2]``; "llama3" scaling as transformers' ``_compute_llama3_parameters`` (Llama 3.1 §3.3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    middle = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(middle, smoothed, out)


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LlamaModel:
    """Build with :meth:`load`; the caller owns ``kv_cache [layers, 2, num_blocks, block_size, kv_heads,
    head_dim]``. Off the CPU the weights are dense (the block kernels are CPU-only). ``tp``: this rank; it keeps
    its shard and runs the per-layer code (no all-reduce inside a kernel); every rank must run the same steps.
    Raises KeyError (a missing tensor), ValueError (``blocks`` off the CPU; with ``tp``, blocks or a bad size)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 blocks: dict[str, quant.Blocks] | None = None, device: str | torch.device = "cpu",
                 weight_format: linear.WeightFormat | None = None, tp: tensor_parallel.TPRank | None = None,
                 retune: bool = False):
        self.dtype = dtype
        self.device = torch.device(device)
        if blocks and self.device.type != "cpu":
            raise ValueError(f"GGUF weight blocks run on the CPU only, not on {self.device}")
        fmt = weight_format or linear.WeightFormat(blocks=blocks is not None, dense=None if blocks else dtype)
        self.weight_format = fmt
        self.tp = tp
        # Each rank's KV heads, in order: the group's KV cache is one part per rank (engine/kv_parts.py).
        self.kv_head_split = [config.num_key_value_heads]
        if tp is not None:
            tensor_parallel.check_dense(fmt)
            shards = [tensor_parallel.shard_ranges(config, r, tp.size) for r in range(tp.size)]
            self.vocab, self.vocab_sizes = shards[tp.rank].vocab, [len(shard.vocab) for shard in shards]
            self.kv_head_split = [len(shard.kv_heads) for shard in shards]
            config, weights = tensor_parallel.shard_weights(config, weights, tp.rank, tp.size)
        self.config = config
        if self.device.type != "cpu":
            weights = {name: w.to(self.device) for name, w in weights.items()}

        def project(names: list[str]) -> linear.Linear:
            return linear.projection(weights, blocks, names, fmt)

        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = project(["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"])
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias = None
            if attn + "q_proj.bias" in weights:  # qwen2
                bias = torch.cat([weights[attn + n + "_proj.bias"] for n in "qkv"])
            layer = {
                "input_norm": weights[p + "input_layernorm.weight"],
                "post_norm": weights[p + "post_attention_layernorm.weight"],
                "qkv": project([attn + n + "_proj.weight" for n in "qkv"]),
                "qkv_bias": bias,
                "o": project([attn + "o_proj.weight"]),
                "gate_up": project([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                "down": project([p + "mlp.down_proj.weight"]),
            }
            self.layers.append(layer)
        self._tune(retune)
        if tp is not None:  # (all-reduces run between a layer's matmuls: no one-call layers)
            for layer in self.layers:
                layer["kernel"] = layer["kernel_large"] = None
        inv_freq = rope_inv_freq(config)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # On the host: the same float32 values on every device.
        self.cos = emb.cos().to(self.device, dtype)
        self.sin = emb.sin().to(self.device, dtype)

    def _tune(self, retune: bool) -> None:
        self.tuned: dict[str, tuning.Tuned] = {}
        self._set_f32_gemm(retune)
        self._set_q4_layout(retune)
        self._set_kernel_rows(retune)
        self._set_prefill_way(retune)

    def _set_f32_gemm(self, retune: bool) -> None:
        """oneDNN-pack the float32 dense copies where oneDNN beat MKL here (``linear.measured_f32_gemm``)."""
        if self.device.type != "cpu" or self.weight_format.dense != torch.float32:
            return
        projections = [[layer[k] for k in PROJECTIONS] for layer in self.layers]
        self.tuned["f32_gemm"] = linear.measured_f32_gemm(projections, retune)
        if self.tuned["f32_gemm"].value == "onednn":
            for lin in (p for layer in projections for p in layer):
                lin.dense = linear.pack(lin.dense)

    def _set_q4_layout(self, retune: bool) -> None:
        """Q4_1 blocks in bit planes where that kernel beat the GGUF's layout here (``linear.measured_q4_layout``)."""
        q4 = [[layer[k] for k in PROJECTIONS if layer[k].blocks is not None and quant.can_plane(layer[k].blocks)]
              for layer in self.layers]
        if not q4[0] or any(len(layer) != len(q4[0]) for layer in q4) or not kernels.AVX512 <= kernels.cpu_flags():
            return
        # Packed once: by the measurement (at a first start) and for the model alike.
        planes = functools.cache(lambda: [[quant.to_planes(p.blocks) for p in layer] for layer in q4])
        self.tuned["q4_1_layout"] = linear.measured_q4_layout(q4, planes, retune)
        if self.tuned["q4_1_layout"].value == "planes":
            for layer, packed in zip(q4, planes()):
                for lin, blocks in zip(layer, packed):
                    lin.blocks = blocks

    def _set_kernel_rows(self, retune: bool) -> None:
        """``kernel``: the fused decode-layer kernel's weights for steps up to ``kernel_rows`` rows (None if 0);
        ``kernel_large`` above it (the dense copies; None without). ``kernel_rows`` is None without blocks."""
        probe = [[layer[k] for k in PROJECTIONS if layer[k].blocks is not None] for layer in self.layers]
        if probe[0]:
            self.tuned["kernel_rows"] = linear.measured_kernel_rows(probe, retune)
        self.kernel_rows = self.tuned["kernel_rows"].value if probe[0] else None
        for lin in [self.lm_head, *(layer[k] for layer in self.layers for k in PROJECTIONS)]:
            lin.kernel_rows = self.kernel_rows or 0
        large = self.kernel_rows is not None and self.weight_format.dense is not None
        for layer in self.layers:
            layer["kernel"] = self._kernel_weights(layer, 1) if self.kernel_rows != 0 else None
            layer["kernel_large"] = self._kernel_weights(layer, self.kernel_rows + 1) if large else None

    def _set_prefill_way(self, retune: bool) -> None:
        """bfloat16 GEMMs make prefill attention bfloat16 (the cache stays float32); SDPA on CUDA, else measured."""
        c = self.config
        self.prefill_attention_dtype = torch.bfloat16 if self.weight_format.dense == torch.bfloat16 else self.dtype
        way = (prefill_attention.measured_way(self.prefill_attention_dtype, c.num_attention_heads,
                                              c.num_key_value_heads, c.head_dim, retune)
               if self.device.type == "cpu" else None)
        self.prefill_way = prefill_attention.SDPA if way is None else way.value
        if way is not None:
            self.tuned["prefill_attention"] = way

    @staticmethod
    def _kernel_weights(layer: dict, rows: int) -> tuple:
        qkv, o, gate_up, down = (layer[k].kernel_tensors(rows) for k in PROJECTIONS)
        return layer["input_norm"], layer["post_norm"], qkv, layer["qkv_bias"], o, gate_up, down

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, weight_format: str = "auto",
             device: str | torch.device = "cpu", tp: tensor_parallel.TPRank | None = None,
             retune: bool = False) -> "LlamaModel":
        """``model_dir`` (Hugging Face layout) into ``dtype`` on ``device``; ``weight_format``: ``model/linear.py``
        (with ``tp`` dense only; full weights read on the host, freed once sharded). Raises ModelLoadError (corrupt
        file, missing tensor) and ValueError (a format the model, dtype or device cannot hold; with ``tp``, a bad
        size)."""
        from safetensors.torch import load_file

        config = ModelConfig.from_dir(model_dir)
        if tp is not None and weight_format != "auto":
            tensor_parallel.check_dense(linear.parse(weight_format))
        has_blocks = tp is None and torch.device(device).type == "cpu" and quant.usable(model_dir)
        fmt = linear.resolve(weight_format, dtype, has_blocks)
        read_to = device if tp is None else "cpu"
        weights = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            try:
                part = load_file(str(file))
            except Exception as exc:
                raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from None
            weights.update({k: v.to(read_to, dtype) for k, v in part.items()})
        if fmt.dense not in (None, dtype):
            # The tensors share one mmap, resident while any lives: clone those kept as loaded (+4 bytes a weight).
            weights = {k: v if k.endswith(("proj.weight", "lm_head.weight")) else v.clone() for k, v in weights.items()}
        blocks = quant.load_blocks(model_dir) if fmt.blocks else None
        try:
            return cls(config, weights, dtype, blocks, device, fmt, tp, retune)
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir}: missing tensor {exc}") from None

    def allocate_kv_cache(self, num_blocks: int, block_size: int, allocator=None,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
        """Zeroed ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (with ``tp``, the rank's KV heads) in
        ``dtype`` (default: the model's), from ``allocator(shape, dtype, device)`` if given (a /dev/shm ``KVPool``
        or a CUDA-IPC ``DevicePool``). Raises ValueError if that returns another shape, dtype or device."""
        c = self.config
        shape = (c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        dtype = dtype or self.dtype
        if allocator is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        kv = allocator(shape, dtype, self.device)
        on_device = kv.device.type == self.device.type and self.device.index in (None, kv.device.index)
        if tuple(kv.shape) != shape or kv.dtype != dtype or not on_device:
            raise ValueError(f"the KV cache allocator gave {tuple(kv.shape)} {kv.dtype} on {kv.device}, "
                             f"not {shape} {dtype} on {self.device}")
        return kv

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[S, vocab]`` (float32) of the rows ``meta.logits_rows``."""
        return self.logits(self.hidden_states(input_ids, meta, kv_cache, embeds, kv_written)[meta.logits_rows])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` (float32) from final hidden states ``[R, hidden]``; with ``tp``, gathered over ranks."""
        logits = self.lm_head(layer_ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)).float()
        return logits if self.tp is None else self.tp.gather_last_dim(logits, self.vocab_sizes)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                      kv_cache: torch.Tensor,
                      embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                      kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """The last layer's hidden states ``[T, hidden]`` before the final norm; writes the new K/V into ``kv_cache``.
        ``embeds``: ``(rows [R], values [R, hidden])`` replacing token embeddings (Idefics3's ``inputs_merger``).
        ``kv_written(layer)``: once that layer's K/V is in the cache (with ``tp``, in every rank's)."""
        c = self.config
        x = self.embed[input_ids] if self.tp is None else self._embed_parallel(input_ids)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        # Decode-only: one kernel call per layer; ``kv_written`` needs the per-layer code.
        kernel = "kernel" if self.kernel_rows is None or len(x) <= self.kernel_rows else "kernel_large"
        fused = not meta.prefills and kv_written is None and layer_ops.fused(x) and self.layers[0][kernel] is not None
        residual = None  # the last layer's MLP output, added to x by the next layer's norm
        for i, layer in enumerate(self.layers):
            if fused:
                layer_ops.decode_layer(x, layer[kernel], kv_cache[i], meta.positions, self.cos, self.sin,
                                       meta.slot_mapping, meta.decode_block_tables, meta.decode_ctx_lens,
                                       c.num_attention_heads, c.rms_norm_eps)
            else:
                residual = self._layer(i, layer, x, residual, meta, kv_cache, kv_written)
        return x if residual is None else x.add_(residual)

    def _embed_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each rank looks up the ids in its vocabulary rows (zeros elsewhere); the ranks' rows are summed."""
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        x = self.embed[local.masked_fill(outside, 0)]
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def _layer(self, i: int, layer: dict, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
               kv_cache: torch.Tensor, kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Layer ``i`` on ``x [T, hidden]`` plus ``residual`` (updated in place); returns this layer's MLP output,
        which the next norm adds (``rms_norm``'s ``delta``). Matmul inputs and outputs stay in the weights' dtype."""
        c = self.config
        n_q, n_kv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        mm = self._matmul_dtype(layer, len(x))
        qkv = layer["qkv"](layer_ops.rms_norm(x, layer["input_norm"], eps, mm, residual), layer["qkv_bias"])
        k_cache = kv_cache[i, 0].view(-1, n_kv, d)
        v_cache = kv_cache[i, 1].view(-1, n_kv, d)
        layer_ops.rope_write_kv(qkv, meta.positions, self.cos, self.sin, k_cache, v_cache, meta.slot_mapping, n_q)
        if kv_written is not None and self.tp is None:
            kv_written(i)
        q, k, v = (part.view(len(qkv), -1, d) for part in qkv.split([n_q * d, n_kv * d, n_kv * d], dim=-1))
        attn = self._attention(q, k, v, kv_cache[i], meta)
        out = layer["o"](attn.reshape(-1, n_q * d).to(mm))
        if self.tp is not None:
            out = self.tp.all_reduce(out.to(x.dtype))  # the ranks' partial sums, in the model's dtype
            if kv_written is not None:  # every rank is past its K/V write of layer i only now
                kv_written(i)
        gate_up = layer["gate_up"](layer_ops.rms_norm(x, layer["post_norm"], eps, mm, out))
        out = layer["down"](layer_ops.silu_mul(gate_up))
        return out if self.tp is None else self.tp.all_reduce(out.to(x.dtype))

    def _matmul_dtype(self, layer: dict, rows: int) -> torch.dtype:
        """The dense copy's dtype when the step runs on it, else the model's (the block kernels take float32)."""
        lin = layer["qkv"]
        return self.dtype if lin.dense is None or lin.on_blocks(rows) else lin.dense.dtype

    def _attention(self, q, k, v, layer_cache, meta: AttentionMetadata) -> torch.Tensor:
        """``[T, heads, head_dim]``; behind cached tokens on CUDA, Triton reads the pool in place."""
        block_size = layer_cache.shape[2]
        decode = None
        if len(meta.decode_rows):
            decode = layer_ops.paged_decode_attention(
                q[meta.decode_rows].to(self.dtype), layer_cache[0].flatten(0, 1), layer_cache[1].flatten(0, 1),
                meta.decode_block_tables, meta.decode_ctx_lens, block_size)
            if not meta.prefills:
                return decode
        at = self.prefill_attention_dtype
        if decode is None and len(meta.prefills) == 1 and meta.prefills[0].q_len == len(q) and not q.is_cuda:
            seq = meta.prefills[0]  # a step of one prompt: its attention is the output, no copy
            return prefill_attention.attend(self.prefill_way, q, k, v, layer_cache, seq.block_table, seq.ctx_len, at)
        out = q.new_empty(q.shape, dtype=at)
        for seq in meta.prefills:
            rows = slice(seq.start, seq.start + seq.q_len)
            if q.is_cuda and seq.ctx_len > seq.q_len:
                from epdserve.model import triton_attention  # CUDA builds of torch only: see layer_ops

                out[rows] = triton_attention.paged_prefill_attention(
                    q[rows], layer_cache[0].flatten(0, 1), layer_cache[1].flatten(0, 1), seq.block_table,
                    seq.ctx_len, block_size)
            else:
                out[rows] = prefill_attention.attend(self.prefill_way, q[rows], k[rows], v[rows], layer_cache,
                                                     seq.block_table, seq.ctx_len, at)
        if decode is not None:
            out[meta.decode_rows] = decode.to(out.dtype)
        return out
