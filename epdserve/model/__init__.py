"""The model: loading (GGUF converted once, Hugging Face directories), config, tokenizer and
chat template, the Llama-family decoder over a paged KV cache, its kernels and weight formats,
the device it runs on, and the SmolVLM vision tower.
"""

__all__ = ["base", "config", "cuda_graphs", "cutover", "device", "gguf_convert", "image_processor", "kernels",
           "layer_ops", "linear", "llama", "loader", "quant", "smolvlm", "tokenizer", "triton_attention",
           "vision"]
