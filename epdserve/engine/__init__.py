"""One worker's engine. Synchronous; the worker does the I/O."""

__all__ = ["block_pool", "encoder", "engine", "guided", "kv_source", "prefix_cache",
           "prompt_logprobs", "request", "runner", "sampler", "scheduler"]
