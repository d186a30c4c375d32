"""The worker processes: the engine worker's loop (:mod:`.engine_worker`, ``epdserve worker``),
the encode worker, their set-up (options, cores, the engine and its shared KV pool), the
control messages both answer, their socket threads, KV and embedding fetches, grammar
preparation off the loop, and a tensor-parallel worker's follower ranks with their control
messages (:mod:`.ranks`, :mod:`.rank_messages`).
"""

__all__ = ["control", "encode_worker", "engine_worker", "fetch", "grammar_prep", "rank_messages", "ranks", "setup",
           "threads"]
