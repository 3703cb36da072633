"""Lightning callbacks: MoE statistics and throughput (more reliability callbacks join them)."""

from mula_lightning.callbacks.moe_stats import MoEStats
from mula_lightning.callbacks.throughput import MulaThroughput

__all__ = ["MoEStats", "MulaThroughput"]
