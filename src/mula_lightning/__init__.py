"""mula_lightning: Lightning / Fabric components for pretraining and upcycling Mixture-of-Experts LLMs.

Subpackages:
    models: single-device Mula model family (config + presets, transformer, HF conversion).
    moe: the MoE block (router, dispatch, grouped experts, combine).
    parallel: process-group topology, collectives, sharded optimizers.
    strategies: Lightning Fabric / Trainer strategies.
    callbacks: reliability and monitoring callbacks.
    data: tokenize -> shuffle -> memmap shards, resumable loading.
    testing: multi-process test helpers.
"""

__version__ = "0.1.0"
