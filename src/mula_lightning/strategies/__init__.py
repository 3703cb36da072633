"""Lightning strategies over :mod:`mula_lightning.parallel`, registered under short names on import.

``import mula_lightning.strategies`` registers ``"epso"`` and ``"zero_topo"`` with both Fabric's and the Trainer's
strategy registries, so ``Fabric(strategy="epso")`` and ``Trainer(strategy="zero_topo")`` work after it (the ``mula``
CLI imports it for you); it also registers the ``"xpu"`` accelerator (:mod:`mula_lightning.accelerators`).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

import mula_lightning.accelerators  # noqa: F401  (registers "xpu" for accelerator: xpu / auto)
from mula_lightning.strategies.epso import EPSOStrategy, FabricEPSOStrategy
from mula_lightning.strategies.zero_topo import FabricZeroTopoStrategy, ZeroTopoStrategy

for _name, _cls, _registry in (
    ("epso", FabricEPSOStrategy, _FABRIC_REGISTRY),
    ("epso", EPSOStrategy, _TRAINER_REGISTRY),
    ("zero_topo", FabricZeroTopoStrategy, _FABRIC_REGISTRY),
    ("zero_topo", ZeroTopoStrategy, _TRAINER_REGISTRY),
):
    if _name not in _registry:
        _cls.register_strategies(_registry)

__all__ = ["EPSOStrategy", "FabricEPSOStrategy", "FabricZeroTopoStrategy", "ZeroTopoStrategy"]
