"""The worker processes: the engine worker's loop (:mod:`.engine_worker`, ``epdserve worker``),
the encode worker, their set-up (options, cores, the engine and its shared KV pool), the
control messages both answer, their socket threads, KV and embedding fetches, and grammar
preparation off the loop.
"""

__all__ = ["control", "encode_worker", "engine_worker", "fetch", "grammar_prep", "setup", "threads"]
