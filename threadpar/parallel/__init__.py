"""Parallel wrappers built on threadpar's process groups: `from threadpar.parallel import ...`."""

from threadpar.parallel import context_parallel, expert_parallel, tensor_parallel
from threadpar.parallel.clip_grad import (
    GradPlacement,
    clip_grad_norm_,
    grad_placements,
    mark_grad_placement,
    mark_grad_placements,
    scale_grads_by_norm_,
    total_grad_norm,
)
from threadpar.parallel.context_parallel import *  # noqa: F403  (context parallelism: ring attention)
from threadpar.parallel.data_parallel import DataParallel
from threadpar.parallel.ddp import DistributedDataParallel
from threadpar.parallel.expert_parallel import *  # noqa: F403  (expert parallelism: MoE with all-to-all)
from threadpar.parallel.loss_scaler import LossScaler
from threadpar.parallel.tensor_parallel import *  # noqa: F403  (tensor and sequence parallelism)
from threadpar.parallel.zero import ZeroRedundancyOptimizer, optimizer_state_bytes

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "GradPlacement",
    "LossScaler",
    "clip_grad_norm_",
    "grad_placements",
    "mark_grad_placement",
    "mark_grad_placements",
    "scale_grads_by_norm_",
    "total_grad_norm",
    "ZeroRedundancyOptimizer",
    "optimizer_state_bytes",
    *tensor_parallel.__all__,
    *context_parallel.__all__,
    *expert_parallel.__all__,
]
