"""Every public name of ``../shared/DESIGN.md`` ("Public surface") imports from the module DESIGN.md names.

Users and tests rely on these paths; a refactor that moves a name must keep it importable here. Every name and
command DESIGN.md promises has landed (the last, ``mula plan``, with issue 61's first step); a promise added to
DESIGN.md gets a strict expected failure here until it lands.
"""

import importlib
import inspect

import pytest

LANDED = {
    "mula_lightning.models": ["MulaConfig", "MulaForCausalLM"],
    "mula_lightning.moe": ["MoEConfig", "FastSparseMoEBlock", "patch_hf_moe"],
    "mula_lightning.parallel": ["apply_expert_parallel", "gather_expert_parallel_state_dict"],
    "mula_lightning.strategies": ["EPSOStrategy", "FabricEPSOStrategy", "ZeroTopoStrategy", "FabricZeroTopoStrategy"],
    "mula_lightning.callbacks": ["DualCheckpoint", "ModelOnlyCheckpoint", "NaNDetector", "MoEStats"],
    "mula_lightning.data": ["prepare", "MulaDataModule"],
    "mula_lightning.lightning_module": ["MulaLM"],
    "mula_lightning.testing": ["run_distributed_test"],
    "mula_lightning.accelerators": ["XPUAccelerator"],
    "mula_lightning.launch": ["Launcher", "LaunchOptions"],
}
METHODS = [
    ("mula_lightning.models", "MulaConfig", ["from_name", "from_hf_config", "num_params"]),
    ("mula_lightning.models", "MulaForCausalLM", ["from_hf", "to_hf"]),
    ("mula_lightning.moe", "FastSparseMoEBlock", ["from_hf"]),
]
PRESETS = ["mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b", "mula-tiny-moe"]
PRESETS += ["mula-tiny-dense"]
COMMANDS = ["fit", "validate", "test", "data", "upcycle", "export", "report", "models", "launch", "plan"]


@pytest.mark.parametrize("module", sorted(LANDED))
def test_landed_public_names_import_from_their_module(module):
    """Each name of the public surface is an attribute of the module DESIGN.md names."""
    mod = importlib.import_module(module)
    missing = [name for name in LANDED[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing}"


def test_methods_presets_registrations_and_commands():
    """The documented methods exist, every preset builds a config, both strategies are registered under their short
    names for Fabric and the Trainer, the ``mula`` console script knows every landed command and ``MulaLM`` takes
    ``init_from``."""
    for module, cls, methods in METHODS:
        owner = getattr(importlib.import_module(module), cls)
        assert all(callable(getattr(owner, m, None)) for m in methods), (cls, methods)
    from mula_lightning.models import MulaConfig

    assert [MulaConfig.from_name(p).name for p in PRESETS] == PRESETS
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import mula_lightning.strategies  # noqa: F401  (registers)

    assert {"epso", "zero_topo"} <= set(STRATEGY_REGISTRY) and {"epso", "zero_topo"} <= set(StrategyRegistry)
    from mula_lightning.cli import COMMANDS as CLI_COMMANDS

    assert set(COMMANDS) <= set(CLI_COMMANDS)
    from mula_lightning.lightning_module import MulaLM

    assert "init_from" in inspect.signature(MulaLM).parameters
    from mula_lightning.strategies.epso import EPSOOptions

    parallel = {"tp_size", "etp_size", "sequence_parallel", "pp_size", "pp_schedule", "pp_microbatches"}
    assert parallel <= set(inspect.signature(EPSOOptions).parameters)
    from mula_lightning.moe import MoEConfig

    assert MoEConfig.__dataclass_fields__.keys() >= {"norm_topk_prob", "capacity_factor", "aux_loss_coef"}


def test_router_families_are_on_the_moe_config():
    """MoEConfig names the router families DESIGN.md lists: score function, group-limited routing, routed scaling,
    the auxiliary-loss-free bias with its update rate, shared experts."""
    from mula_lightning.moe import MoEConfig

    fields = set(MoEConfig.__dataclass_fields__)
    assert {"score_function", "n_group", "topk_group", "routed_scaling_factor", "bias_update_rate"} <= fields
    assert {"shared_experts", "shared_expert_intermediate_size", "shared_expert_gate"} <= fields
