"""The planner (``epdserve plan``): profiles, the cost model, the SimPy simulation, the goodput
search, calibration against compare runs and the report.
"""

__all__ = ["calibrate", "costmodel", "elastic_replay", "hardware", "model_spec", "replay",
           "report", "run", "search", "serving_fit", "sim_elastic", "sim_worker", "simulate",
           "validation"]
