"""A model's size as the cost model needs it: parameters, FLOPs and KV bytes per token."""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape (Hugging Face field meanings). ``mlp_matrices``: 3 for a gated MLP
    (Llama, Qwen: gate, up, down), 2 for a plain one (OPT: fc1, fc2).
    ``image_tokens`` / ``vision_params``: embeddings per image and vision-tower
    parameters, 0 for a text-only model."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mlp_matrices: int = 3
    image_tokens: int = 0
    vision_params: int = 0

    @classmethod
    def from_config(cls, name: str, c: ModelConfig) -> "ModelSpec":
        return cls(name, c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                   c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)

    @property
    def layer_params(self) -> int:
        """Weights of all decoder layers (attention projections + MLP), not embeddings."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return self.num_layers * (attention + self.mlp_matrices * h * self.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """layers × 2 (K and V) × KV heads × head dim × bytes per element."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, new_tokens: int, context: int) -> float:
        """FLOPs of QK^T and PV for ``new_tokens`` queries after ``context`` cached tokens,
        causal: 4 × layers × heads × head_dim × Σ keys seen (2 matmuls × 2 FLOPs/MAC)."""
        keys = new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * keys

    def embedding_bytes_per_image(self, dtype_bytes: int) -> int:
        return self.image_tokens * self.hidden_size * dtype_bytes


# Published architectures used to check the planner against published results.
BUILTIN: dict[str, ModelSpec] = {s.name: s for s in (
    # facebook/opt-13b config.json: 40 layers, 5120 hidden, 40 heads, ffn 20480, vocab 50272.
    ModelSpec("OPT-13B", 40, 5120, 20480, 40, 40, 128, 50272, mlp_matrices=2),
    # Qwen/Qwen3-32B config.json: 64 layers, 5120 hidden, 64 q / 8 kv heads of 128, ffn 25600.
    ModelSpec("Qwen3-32B", 64, 5120, 25600, 64, 8, 128, 151936),
    # meta-llama/Llama-3.1-8B config.json.
    ModelSpec("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256),
)}
