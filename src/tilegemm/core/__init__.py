"""The runtime under every op family: backend choice, registry, launches and replays, tuning, hardware facts,
dtype names, result checks. Nothing here imports an op family."""

__version__ = "0.1.0"
