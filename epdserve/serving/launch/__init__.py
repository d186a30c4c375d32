"""``epdserve serve``: the launcher (:mod:`.launcher`: options, placement on cores, memory check,
the router in-process), Ray placement (:mod:`.ray_cluster`) and child supervision
(:mod:`.children`).
"""

__all__ = ["children", "launcher", "ray_cluster"]
