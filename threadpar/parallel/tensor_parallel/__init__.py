"""Tensor and sequence parallelism: autograd mappings, Column/Row/Vocab-parallel layers, vocab-parallel
cross-entropy, the TP random streams, sequence-parallel gradient sync, and `parallelize`. (The stream
names INIT / REPLICATED / TP_REGION and the functional `dropout` are internals of .random.)"""

from threadpar.parallel.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropyLoss,
    vocab_parallel_cross_entropy,
)
from threadpar.parallel.tensor_parallel.embedding import VocabParallelEmbedding
from threadpar.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from threadpar.parallel.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
)
from threadpar.parallel.tensor_parallel.parallelize import (
    ColwiseParallel,
    DropoutParallel,
    RowwiseParallel,
    SequenceParallel,
    VocabParallel,
    parallelize,
)
from threadpar.parallel.tensor_parallel.random import RNGTracker, TrackedDropout, get_rng_tracker
from threadpar.parallel.tensor_parallel.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    mark_sequence_parallel,
    sequence_parallel_parameters,
)
from threadpar.parallel.tensor_parallel.sharding import (
    ShardSpec,
    TensorParallelModule,
    gather_dense_grads,
    gather_dense_state_dict,
    padded_size,
)

__all__ = [
    "ColumnParallelLinear",
    "ColwiseParallel",
    "DropoutParallel",
    "RNGTracker",
    "RowParallelLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "ShardSpec",
    "TensorParallelModule",
    "TrackedDropout",
    "VocabParallel",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp_region",
    "gather_dense_grads",
    "gather_dense_state_dict",
    "gather_from_sp_region",
    "gather_from_tp_region",
    "get_rng_tracker",
    "mark_sequence_parallel",
    "padded_size",
    "parallelize",
    "reduce_from_tp_region",
    "reduce_scatter_to_sp_region",
    "scatter_to_sp_region",
    "scatter_to_tp_region",
    "sequence_parallel_parameters",
    "vocab_parallel_cross_entropy",
]
