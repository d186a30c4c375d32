__all__ = ["children", "launcher", "ray_cluster"]
