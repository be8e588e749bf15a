"""Autograd mappings between replicated, hidden-sharded and sequence-sharded activations of a TP group.

They come in conjugate pairs (the backward of one is the forward of the other), as in Megatron:

    copy_to_tp_region          identity        | all-reduce       enter the TP region with a replicated input
    reduce_from_tp_region      all-reduce      | identity         leave it by summing partial outputs
    scatter_to_tp_region       split last dim  | all-gather       shard a replicated input by features
    gather_from_tp_region      all-gather      | split last dim   replicate a feature-sharded output
    scatter_to_sp_region       split seq dim   | all-gather       shard a replicated input by sequence
    gather_from_sp_region      all-gather      | reduce-scatter   (or split) enter the TP region under SP
    reduce_scatter_to_sp_region reduce-scatter | all-gather       leave the TP region under SP

Every mapping is the identity for a group of one rank. The group handle is stored on the autograd ctx
when the forward runs (DESIGN.md rule 2): backward may run on a thread with no rank context.
`group=None` resolves this rank's TP group at that moment, so call these on the rank thread; modules
pass the handle they captured when built. `dim` is the sequence dim: 1 for [batch, seq, hidden].
"""

from __future__ import annotations

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.parallel.tensor_parallel.collectives import (
    all_gather_along_dim,
    all_reduce_copy,
    reduce_scatter_along_dim,
    resolve_tp_group,
    split_along_dim,
)

SEQ = "the sequence length"
FEATURES = "the feature (last) dim"


class _CopyToTPRegion(torch.autograd.Function):
    """Copy forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """All-reduce forward, copy backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    """Split the last dim forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group, FEATURES)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    """All-gather the last dim forward, split it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group, FEATURES), None


class _ScatterToSPRegion(torch.autograd.Function):
    """Split the sequence dim forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along_dim(x, dim, group, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSPRegion(torch.autograd.Function):
    """All-gather the sequence dim forward; reduce-scatter it backward (or split, for replicated consumers)."""

    @staticmethod
    def forward(ctx, x, group, dim, tensor_parallel_output_grad):
        ctx.group, ctx.dim, ctx.reduce = group, dim, tensor_parallel_output_grad
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return reduce_scatter_along_dim(grad, ctx.dim, ctx.group, SEQ), None, None, None
        return split_along_dim(grad, ctx.dim, ctx.group, SEQ), None, None, None


class _ReduceScatterToSPRegion(torch.autograd.Function):
    """Reduce-scatter the sequence dim forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along_dim(x, dim, group, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """Copy forward, all-reduce backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """All-reduce forward, copy backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """Split the last dim forward (keep this rank's slice), all-gather backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """All-gather the last dim forward, split backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _GatherFromTPRegion.apply(x, group)


def scatter_to_sp_region(
    x: torch.Tensor, group: ProcessGroup | str | None = None, *, dim: int = 1
) -> torch.Tensor:
    """Split the sequence dim forward (keep this rank's slice), all-gather backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _ScatterToSPRegion.apply(x, group, dim)


def gather_from_sp_region(
    x: torch.Tensor,
    group: ProcessGroup | str | None = None,
    *,
    dim: int = 1,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """All-gather the sequence dim forward; backward reduce-scatter, or split when
    `tensor_parallel_output_grad=False` (the consumer is replicated, so its gradients are already whole)."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _GatherFromSPRegion.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(
    x: torch.Tensor, group: ProcessGroup | str | None = None, *, dim: int = 1
) -> torch.Tensor:
    """Reduce-scatter the sequence dim forward, all-gather backward."""
    group = resolve_tp_group(group)
    return x if group.size() == 1 else _ReduceScatterToSPRegion.apply(x, group, dim)
