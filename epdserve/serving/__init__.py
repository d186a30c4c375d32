"""The serving processes, in subpackages by role that import only downward (the import-linter contract
in pyproject.toml; the map: docs/architecture.md)."""

__all__ = ["api", "elastic", "launch", "router", "worker", "auth", "deployment", "flags",
           "handshake", "metrics", "protocol"]
