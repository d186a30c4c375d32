"""The model: loading, config, tokenizer, the Llama-family decoder and its kernels, the SmolVLM vision tower."""

__all__ = ["base", "config", "cuda_graphs", "cutover", "device", "gguf_convert", "image_processor", "kernels",
           "layer_ops", "linear", "llama", "loader", "quant", "smolvlm", "tokenizer", "triton_attention",
           "vision"]
