"""Tensor-level collectives over a tensor-parallel group: split, all-gather, reduce-scatter along one dim.

Plain functions of a captured ProcessGroup handle, with no autograd: the autograd mappings and the
gathering of sharded state dicts are built from them. Every buffer handed to the group is contiguous.
The pieces of an all-gather land along a new leading dim ([tp, *piece]) and are moved to `dim` with one
copy; for dim 0 (Megatron's [seq, batch, hidden] layout) that is a free view. None of these functions
modifies its input: results are new tensors.
"""

from __future__ import annotations

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.groups import resolve_group


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ConfigError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def divide(total: int, parts: int, what: str) -> int:
    """total / parts, or a ConfigError naming `what` when it does not divide evenly."""
    if total % parts:
        raise ConfigError(
            f"{what} is {total}, which is not divisible by the tensor-parallel size {parts}; "
            f"choose a multiple of {parts}"
        )
    return total // parts


def all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of `x` over the group, in a new tensor (the input may be shared with other autograd nodes)."""
    out = x.clone(memory_format=torch.contiguous_format)
    group.all_reduce(out)
    return out


def split_along_dim(
    x: torch.Tensor, dim: int, group: ProcessGroup, what: str = "the split dim"
) -> torch.Tensor:
    """This member's 1/tp slice of `x` along `dim` (contiguous)."""
    dim = normalize_dim(dim, x.dim())
    local = divide(x.shape[dim], group.size(), f"{what} (size of dim {dim} of a {list(x.shape)} tensor)")
    return x.narrow(dim, group.rank() * local, local).contiguous()


def all_gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """The members' tensors concatenated along `dim`, member order."""
    dim = normalize_dim(dim, x.dim())
    tp = group.size()
    stacked = torch.empty((tp, *x.shape), dtype=x.dtype, device=x.device)  # [tp, *x.shape]
    group.all_gather_into_tensor(stacked, x.contiguous())
    # [tp, ..., n, ...] -> [..., tp, n, ...] -> [..., tp * n, ...]; no copy when dim == 0.
    shape = list(x.shape)
    shape[dim] *= tp
    return stacked.movedim(0, dim).reshape(shape)


def reduce_scatter_along_dim(
    x: torch.Tensor, dim: int, group: ProcessGroup, what: str = "the scattered dim"
) -> torch.Tensor:
    """This member's 1/tp slice along `dim` of the sum of the members' tensors."""
    dim = normalize_dim(dim, x.dim())
    tp = group.size()
    local = divide(x.shape[dim], tp, f"{what} (size of dim {dim} of a {list(x.shape)} tensor)")
    # [..., tp * n, ...] -> [tp, ..., n, ...] contiguous, the layout reduce_scatter_tensor splits along dim 0;
    # a view when dim == 0 and x is contiguous.
    pieces = x.unflatten(dim, (tp, local)).movedim(dim, 0).contiguous()
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    group.reduce_scatter_tensor(out, pieces)
    return out


def resolve_tp_group(group: ProcessGroup | str | None) -> ProcessGroup:
    """`group` as a handle: None means this rank's TP group; an axis or group name is looked up.

    Call it when a layer or Function is built, on the rank thread, never inside backward.
    """
    return resolve_group(group, "TP")
