"""parallel: expert, tensor and pipeline parallelism, the process mesh, autograd collectives, the communication ledger.

``collectives`` holds the Algorithm 1 collectives (``forward_allgather_backward_reducescatter`` ...) and plain
functional wrappers; ``ledger`` records the bytes each of them sends, per topology level. ``apply_expert_parallel``
cuts a model's (or a bare block's) experts to the rank's slice (and, with ``etp_size``, to a part of their
intermediate dimension) and sets an ``AllGatherDispatcher`` or ``AllToAllDispatcher`` (``token_dispatchers``) on each
MoE block, in place. ``ParallelDims`` / ``build_parallel_mesh`` lay every dimension (dense ``pp x dp x cp x tp``, MoE
``pp x edp x ep x etp``) over the same ranks; ``apply_tensor_parallel`` shards a Mula model's dense parts with
DTensor; ``split_into_stages`` / ``build_schedule`` run it as a pipeline with ``torch.distributed.pipelining``,
``prune_to_stages`` keeps only a rank's stages and ``PipelineRunner`` runs its training and evaluation steps (what the
``epso`` strategy's ``pipeline_step`` calls).
"""

from mula_lightning.parallel.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    exchange_split_counts,
    exchange_split_sizes,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
    reduce_scatter_tensor,
)
from mula_lightning.parallel.expert_parallel import apply_expert_parallel, gather_expert_parallel_state_dict
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.parallel.ledger import CommLedger, CommRecord, CommTotals, is_recording, ring_bytes_sent
from mula_lightning.parallel.mesh import ParallelDims, ParallelMesh, build_parallel_mesh
from mula_lightning.parallel.pipeline import build_schedule, prune_to_stages, split_into_stages
from mula_lightning.parallel.pipeline_runner import PipelineLoss, PipelineRunner
from mula_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mula_lightning.parallel.token_dispatchers import AllGatherDispatcher, AllToAllDispatcher

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "CommLedger",
    "CommRecord",
    "CommTotals",
    "HardwareTopology",
    "ParallelDims",
    "ParallelMesh",
    "PipelineLoss",
    "PipelineRunner",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "apply_expert_parallel",
    "apply_tensor_parallel",
    "build_parallel_mesh",
    "build_schedule",
    "exchange_split_counts",
    "exchange_split_sizes",
    "forward_allgather",
    "forward_allgather_backward_reducescatter",
    "forward_reducescatter_backward_allgather",
    "gather_expert_parallel_state_dict",
    "is_recording",
    "prune_to_stages",
    "reduce_scatter_tensor",
    "ring_bytes_sent",
    "split_into_stages",
]
