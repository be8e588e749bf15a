"""The parallel building blocks a model is written with: `from threadpar.parallel import ...`.

An explicit list, not the sub-packages' whole surface: their internals (the RNG stream names INIT /
REPLICATED / TP_REGION, routing's `assign`, sharding specs, dispatchers) stay importable from their modules
(threadpar.parallel.tensor_parallel.random, ...expert_parallel.routing, ...) but are not part of this API.
Naming: `parallelize`'s parallelize_plan entries are named as torch.distributed.tensor.parallel's styles
(ColwiseParallel, RowwiseParallel, ..., DropoutParallel: "<what> becomes parallel"); the modules they
install are named for what they are (ColumnParallelLinear, TrackedDropout: nn.Dropout drawing from the
rank's RNG tracker), so a parallelize_plan entry and a module never share a name's words in another order.
"""

from threadpar.parallel.clip_grad import (
    GradPlacement,
    clip_grad_norm_,
    grad_placements,
    mark_grad_placement,
    mark_grad_placements,
    scale_grads_by_norm_,
    total_grad_norm,
)
from threadpar.parallel.context_parallel import (
    RingAttention,
    allreduce_context_parallel_grads,
    context_tensor_parallel_group,
    data_context_parallel_group,
    gather_sequence,
    get_padding,
    load_balanced_indices,
    pad_sequence,
    restore_sequence_order,
    ring_attention,
    split_sequence,
)
from threadpar.parallel.data_parallel import DataParallel
from threadpar.parallel.ddp import DistributedDataParallel
from threadpar.parallel.expert_parallel import (
    MoE,
    MoEConfig,
    MoEStats,
    TopKRouter,
    allreduce_moe_grads,
    expert_groups,
    expert_parallel_groups,
    expert_parameters,
    load_balancing_loss,
)
from threadpar.parallel.loss_scaler import LossScaler
from threadpar.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    DropoutParallel,
    RowParallelLinear,
    RowwiseParallel,
    SequenceParallel,
    TrackedDropout,
    VocabParallel,
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    gather_dense_grads,
    gather_dense_state_dict,
    gather_from_sp_region,
    gather_from_tp_region,
    get_rng_tracker,
    mark_sequence_parallel,
    parallelize,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
    sequence_parallel_parameters,
    vocab_parallel_cross_entropy,
)
from threadpar.parallel.zero import ZeroRedundancyOptimizer, optimizer_state_bytes

__all__ = [  # noqa: RUF022 (grouped by kind of parallelism, then by use)
    # data parallelism
    "DataParallel",
    "DistributedDataParallel",
    # distributed optimizer (ZeRO-1/2 over the DP group)
    "ZeroRedundancyOptimizer",
    "optimizer_state_bytes",
    # gradient clipping and mixed precision (the whole model's norm over every parallel axis)
    "clip_grad_norm_",
    "total_grad_norm",
    "scale_grads_by_norm_",
    "GradPlacement",
    "grad_placements",
    "mark_grad_placement",
    "mark_grad_placements",
    "LossScaler",
    # tensor and sequence parallelism: layers, loss, dropout
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelCrossEntropyLoss",
    "vocab_parallel_cross_entropy",
    "TrackedDropout",
    "get_rng_tracker",
    # tensor parallelism: the entries of parallelize(model, parallelize_plan)
    "parallelize",
    "ColwiseParallel",
    "RowwiseParallel",
    "VocabParallel",
    "SequenceParallel",
    "DropoutParallel",
    # tensor and sequence parallelism: autograd mappings and gradients
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sp_region",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
    "allreduce_sequence_parallel_grads",
    "mark_sequence_parallel",
    "sequence_parallel_parameters",
    # dense state of a sharded model (checkpoints, checks)
    "gather_dense_state_dict",
    "gather_dense_grads",
    # context parallelism
    "RingAttention",
    "ring_attention",
    "split_sequence",
    "gather_sequence",
    "pad_sequence",
    "get_padding",
    "load_balanced_indices",
    "restore_sequence_order",
    "allreduce_context_parallel_grads",
    "data_context_parallel_group",
    "context_tensor_parallel_group",
    # expert parallelism
    "MoE",
    "MoEConfig",
    "MoEStats",
    "TopKRouter",
    "load_balancing_loss",
    "expert_groups",
    "expert_parallel_groups",
    "expert_parameters",
    "allreduce_moe_grads",
]
