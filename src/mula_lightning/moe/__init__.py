"""Mixture-of-Experts building blocks: router, dispatch, grouped experts, combine and the blocks built from them.

``ReferenceMoEBlock`` is the plain loop every fast path is checked against; ``FastSparseMoEBlock`` is Algorithm 1
of the Aurora paper (token counting, index generation, grouped GEMMs, weighted combine) and the default MoE block
of ``MulaForCausalLM``, with one forward whose token movement is a swappable ``TokenDispatcher``
(``LocalDispatcher`` here; expert parallelism sets a communicating one in place); ``patch_hf_moe`` swaps it into
transformers' OLMoE, Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 models; ``update_expert_bias`` is the
auxiliary-loss-free balancing step (``moe/balancing.py``). Both are built from a ``MoEConfig`` (the leaf
``moe/config.py``; a model config hands its own over as ``config.moe``): this package imports nothing from
``models/``.
"""

from mula_lightning.moe.balancing import install_expert_bias_update, update_expert_bias
from mula_lightning.moe.block import FastSparseMoEBlock, patch_hf_moe
from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.config import MoEConfig
from mula_lightning.moe.dispatch import DispatchPlan, build_dispatch_plan, count_tokens, reduce_rows_to_tokens
from mula_lightning.moe.experts import GroupedExperts, grouped_mm, grouped_mm_available
from mula_lightning.moe.reference import ExpertWeights, MoEAux, ReferenceMoEBlock
from mula_lightning.moe.router import Router, RouterOutput
from mula_lightning.moe.token_dispatcher import DispatchedTokens, LocalDispatcher, TokenDispatcher

__all__ = [
    "DispatchPlan",
    "DispatchedTokens",
    "ExpertWeights",
    "FastSparseMoEBlock",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEAux",
    "MoEConfig",
    "ReferenceMoEBlock",
    "Router",
    "RouterOutput",
    "TokenDispatcher",
    "build_dispatch_plan",
    "combine_expert_outputs",
    "count_tokens",
    "grouped_mm",
    "grouped_mm_available",
    "install_expert_bias_update",
    "patch_hf_moe",
    "reduce_rows_to_tokens",
    "update_expert_bias",
]
