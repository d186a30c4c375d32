"""The worker processes: the engine worker (``epdserve worker``), the encode worker, and the parts
they delegate to."""

__all__ = ["control", "encode_worker", "engine_worker", "fetch", "grammar_prep", "image_encoder", "rank_messages",
           "rank_watch", "ranks", "setup", "stats_report", "threads"]
