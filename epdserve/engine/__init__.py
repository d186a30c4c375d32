"""One worker's engine: requests, the block pool and prefix cache, the scheduler, the runner,
the sampler, the engine loop and the encode engine. Synchronous; the worker does the I/O.
"""

__all__ = ["block_pool", "encoder", "engine", "guided", "kv_source", "prefix_cache",
           "prompt_logprobs", "request", "runner", "sampler", "scheduler"]
