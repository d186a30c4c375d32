"""Elastic roles (``serve --elastic``): pure decisions on the router's samples; its controller applies them."""

__all__ = ["policy", "samples", "scaling", "windowed"]
