"""Lightning callbacks: reliability (Aurora paper, Section 4: dual checkpoints, persistent model-only checkpoints,
NaN detection; for ``mula launch``: heartbeats and injected faults) and monitoring (MoE statistics, throughput, the
final step's metrics, progress lines, straggler scores; a signal's stop saved at a step boundary).

The classes are imported lazily (PEP 562), so that code which only needs the checkpoint protocol
(:mod:`mula_lightning.checkpoint.slots`, no Lightning dependency) does not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DualCheckpoint": "mula_lightning.callbacks.dual_checkpoint",
    "ModelOnlyCheckpoint": "mula_lightning.callbacks.model_only_checkpoint",
    "NaNDetector": "mula_lightning.callbacks.nan_detector",
    "NAN_EXIT_CODE": "mula_lightning.callbacks.nan_detector",
    "MoEStats": "mula_lightning.callbacks.moe_stats",
    "MulaThroughput": "mula_lightning.callbacks.throughput",
    "LastStepLogger": "mula_lightning.callbacks.last_step_logger",
    "MulaProgress": "mula_lightning.callbacks.progress",
    "Heartbeat": "mula_lightning.callbacks.heartbeat",
    "FaultInjector": "mula_lightning.callbacks.fault_injection",
    "GracefulStop": "mula_lightning.callbacks.graceful_stop",
    "MulaModelSummary": "mula_lightning.callbacks.model_summary",
    "StragglerDetection": "mula_lightning.callbacks.straggler_detection",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
