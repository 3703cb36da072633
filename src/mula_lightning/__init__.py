"""mula_lightning: Lightning / Fabric components for pretraining and upcycling Mixture-of-Experts LLMs.

Subpackages:
    utils: leaves every package shares (device, dist, atomic io, safe checkpoint reading, precision).
    moe: the MoE layer (leaf MoEConfig, router, dispatch plan, token dispatchers, grouped experts, combine, one
        FastSparseMoEBlock forward); imports nothing from models.
    models: single-device Mula model family (config + presets, transformer, HF conversion, upcycling).
    parallel: topology, collectives, expert parallelism (dispatchers swapped in place), sharded optimizers,
        parallelize(); zero/ holds the hierarchical ZeRO engine.
    checkpoint: formats and protocols (one DCP format, DP-scattered planner, dual slots, export).
    strategies: thin Lightning Fabric / Trainer strategies and the ShardingStrategy protocol MulaLM talks through.
    callbacks: Lightning callbacks only (reliability, monitoring, heartbeats and fault drills for mula launch).
    accelerators: the Intel XPU accelerator for the Trainer and Fabric (registered as "xpu").
    launch: `mula launch`, relaunching around failed nodes with buffer nodes.
    data: tokenize -> shuffle -> memmap shards, integrity checks, resumable loading.
    testing: multi-process test helpers and the parity rule.

Dependencies point one way: utils <- moe <- models <- parallel <- checkpoint <- strategies / callbacks <-
lightning_module <- cli (tests/test_structure.py checks that no file imports itself back).
"""

__version__ = "0.1.0"
