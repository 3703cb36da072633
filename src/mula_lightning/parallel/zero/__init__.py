"""parallel.zero: the 3-level hierarchical ZeRO of the ZeRO-topo paper (Frontier), as one engine.

``layout`` places every rank in the three groups (weights over a small group, gradients within a node, optimizer
states over all ranks) with one shard-nesting rule; ``quantization`` packs block-wise INT8 / INT4 values;
``collectives`` gathers weights and reduce-scatters gradients over those groups, quantized where asked;
``engine`` (:class:`HierarchicalZeroAdamW`) runs forward gathers, gradient reduction and the sharded AdamW step;
``state_dict`` gives its weights and optimizer states logical keys for checkpoints at any layout.
"""

from mula_lightning.parallel.zero.engine import HierarchicalZeroAdamW
from mula_lightning.parallel.zero.layout import ZeroTopoLayout

__all__ = ["HierarchicalZeroAdamW", "ZeroTopoLayout"]
