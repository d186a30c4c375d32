"""The planner (``epdserve plan``): cost models, the SimPy simulation, the goodput search,
calibration and validation."""

__all__ = ["calibrate", "costmodel", "elastic_replay", "hardware", "model_spec", "options", "replay",
           "report", "run", "search", "serving_fit", "sim_elastic", "sim_worker", "simulate",
           "validation"]
