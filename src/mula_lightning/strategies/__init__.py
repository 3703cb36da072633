"""Lightning strategies over :mod:`mula_lightning.parallel`, registered under short names on import.

``import mula_lightning.strategies`` registers ``"epso"`` with both Fabric's and the Trainer's strategy
registries, so ``Fabric(strategy="epso")`` and ``Trainer(strategy="epso")`` work after it (the ``mula`` CLI
imports it for you).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from mula_lightning.strategies.epso import EPSOStrategy, FabricEPSOStrategy

for _cls, _registry in ((FabricEPSOStrategy, _FABRIC_REGISTRY), (EPSOStrategy, _TRAINER_REGISTRY)):
    if "epso" not in _registry:
        _cls.register_strategies(_registry)

__all__ = ["EPSOStrategy", "FabricEPSOStrategy"]
