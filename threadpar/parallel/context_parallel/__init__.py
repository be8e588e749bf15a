"""Context parallelism: a sequence split over the CP group (load-balanced for causal attention), exact
ring attention over it, and the padding and gradient helpers around them."""

from threadpar.parallel.context_parallel.gradients import allreduce_context_parallel_grads
from threadpar.parallel.context_parallel.ring_attention import RingAttention, ring_attention
from threadpar.parallel.context_parallel.sequence_shards import (
    gather_sequence,
    get_padding,
    load_balanced_chunks,
    load_balanced_indices,
    pad_sequence,
    padding_multiple,
    restore_sequence_order,
    split_sequence,
)
from threadpar.parallel.groups import context_tensor_parallel_group, data_context_parallel_group

__all__ = [
    "RingAttention",
    "allreduce_context_parallel_grads",
    "context_tensor_parallel_group",
    "data_context_parallel_group",
    "gather_sequence",
    "get_padding",
    "load_balanced_chunks",
    "load_balanced_indices",
    "pad_sequence",
    "padding_multiple",
    "restore_sequence_order",
    "ring_attention",
    "split_sequence",
]
