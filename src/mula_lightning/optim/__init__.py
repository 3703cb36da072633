"""Optimizers as single-device math: Muon with its AdamW split (:mod:`~mula_lightning.optim.muon`). Their sharded
forms live with the sharded optimizers in :mod:`mula_lightning.parallel`."""

from mula_lightning.optim.muon import MuonAdamW, is_muon_matrix, muon_param_groups, newton_schulz

#: the optimizers ``MulaLM(optimizer=...)`` and ``mula plan --optimizer`` know
OPTIMIZERS = ("adamw", "muon")

__all__ = ["OPTIMIZERS", "MuonAdamW", "is_muon_matrix", "muon_param_groups", "newton_schulz"]
