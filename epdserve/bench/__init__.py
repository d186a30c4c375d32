"""Measuring deployments: workloads, the streaming client, metrics, ``epdserve compare``."""

__all__ = ["arrivals", "client", "compare", "compare_options", "datasets", "deployment_run", "deployments",
           "engine_metrics", "images", "metrics", "paired", "plots", "processes", "production",
           "production_formats", "prompts", "recommend", "repeats", "report", "result_file",
           "rounds", "rules", "run", "server_metrics", "server_trace", "sweep", "tables", "traces",
           "workload", "workload_options"]
