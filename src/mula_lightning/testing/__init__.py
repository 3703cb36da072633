"""Helpers for the project's own tests (and users' tests): real multi-process runs and accelerator markers.

``run_distributed_test(fn, world_size, backend="gloo")`` runs a module-level function on several processes with an
initialised process group and returns the per-rank results; ``assert_parity(actual, expected, reduction_len=...)``
compares a fast or distributed result with its reference under one rule (``reduction_len x eps(dtype) x scale``, see
:mod:`mula_lightning.testing.parity`); ``requires_gpu`` and ``BACKENDS`` let tests cover CUDA / XPU when present while
passing on a CPU-only machine; ``one_process_data_parallel`` is the one-process reference of a DP run;
``no_host_reads`` proves a hot path reads no tensor value back to the host, ``counting_host_reads`` says which reads
a step makes and where.
"""

from mula_lightning.testing.distributed import DistributedTestError, run_distributed_test, run_pooled_test
from mula_lightning.testing.host_reads import HostReads, counting_host_reads, no_host_reads
from mula_lightning.testing.markers import BACKENDS, available_backends, gpu_available, requires_gpu
from mula_lightning.testing.parity import adamw_parameter_scale, assert_parity, parity_tolerance
from mula_lightning.testing.reference import one_process_data_parallel

__all__ = [
    "BACKENDS",
    "DistributedTestError",
    "HostReads",
    "adamw_parameter_scale",
    "assert_parity",
    "available_backends",
    "counting_host_reads",
    "gpu_available",
    "no_host_reads",
    "one_process_data_parallel",
    "parity_tolerance",
    "requires_gpu",
    "run_distributed_test",
    "run_pooled_test",
]
