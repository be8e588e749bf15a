"""Tensor-level collectives over a tensor-parallel group: split, all-gather, reduce-scatter along one dim.

Plain functions of a captured ProcessGroup handle, with no autograd: the autograd mappings and the
gathering of sharded state dicts are built from them. Every buffer handed to the group is contiguous.
The pieces of an all-gather land along a new leading dim ([tp, *piece]) and are moved to `dim` with one
copy; for dim 0 (Megatron's [seq, batch, hidden] order) that is a free view. None of these functions
modifies its input (except `start_all_reduce_`, which says so): results are new tensors.

Each collective also comes as `start_*`, which launches it with `async_op=True` and returns a `Pending`:
the caller computes something else while it runs, then `pending.wait()` gives the result (on the threads
backend the op runs on the rank's comm worker; on nccl on the group's comm stream, and `wait()` orders
the caller's stream after it without blocking the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from threadpar.comm.common.work import Work
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


class Pending:
    """A collective in flight: `wait()` waits for it and returns its result."""

    __slots__ = ("_finish", "_work")

    def __init__(self, work: Work | None, finish: Callable[[], torch.Tensor]) -> None:
        self._work = work  # None: it already ran (a synchronous op)
        self._finish = finish  # turns the collective's buffer into the result, once it is done

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish()


def _all_reduce_(x: torch.Tensor, group: ProcessGroup, async_op: bool) -> Pending:
    work = group.all_reduce(x, async_op=async_op)
    return Pending(work, lambda: x)


def all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of `x` over the group, in a new tensor (the input may be shared with other autograd nodes)."""
    return _all_reduce_(x.clone(memory_format=torch.contiguous_format), group, False).wait()


def start_all_reduce_(x: torch.Tensor, group: ProcessGroup) -> Pending:
    """Launch the sum of `x` over the group IN PLACE (x contiguous, owned by the caller, untouched until
    `wait()`); `wait()` returns `x`, now the sum."""
    return _all_reduce_(x, group, True)


def split_along_dim(
    x: torch.Tensor, dim: int, group: ProcessGroup, what: str = "the split dim"
) -> torch.Tensor:
    """This member's 1/tp slice of `x` along `dim` (contiguous)."""
    dim = normalize_dim(dim, x.dim())
    local = divide(x.shape[dim], group.size(), f"{what} (size of dim {dim} of a {list(x.shape)} tensor)")
    return x.narrow(dim, group.rank() * local, local).contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup, async_op: bool) -> Pending:
    dim = normalize_dim(dim, x.dim())
    tp = group.size()
    stacked = torch.empty((tp, *x.shape), dtype=x.dtype, device=x.device)  # [tp, *x.shape]
    work = group.all_gather_into_tensor(stacked, x.contiguous(), async_op=async_op)
    shape = list(x.shape)
    shape[dim] *= tp
    # [tp, ..., n, ...] -> [..., tp, n, ...] -> [..., tp * n, ...]; no copy when dim == 0.
    return Pending(work, lambda: stacked.movedim(0, dim).reshape(shape))


def all_gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """The members' tensors concatenated along `dim`, member order."""
    return _all_gather(x, dim, group, False).wait()


def start_all_gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> Pending:
    """Launch `all_gather_along_dim`; `x` must stay unchanged until `wait()`."""
    return _all_gather(x, dim, group, True)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, what: str, async_op: bool) -> Pending:
    dim = normalize_dim(dim, x.dim())
    tp = group.size()
    local = divide(x.shape[dim], tp, f"{what} (size of dim {dim} of a {list(x.shape)} tensor)")
    # [..., tp * n, ...] -> [tp, ..., n, ...] contiguous, the order reduce_scatter_tensor splits along dim 0;
    # a view when dim == 0 and x is contiguous.
    pieces = x.unflatten(dim, (tp, local)).movedim(dim, 0).contiguous()
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    work = group.reduce_scatter_tensor(out, pieces, async_op=async_op)
    return Pending(work, lambda: out)


def reduce_scatter_along_dim(
    x: torch.Tensor, dim: int, group: ProcessGroup, what: str = "the scattered dim"
) -> torch.Tensor:
    """This member's 1/tp slice along `dim` of the sum of the members' tensors."""
    return _reduce_scatter(x, dim, group, what, False).wait()


def start_reduce_scatter_along_dim(
    x: torch.Tensor, dim: int, group: ProcessGroup, what: str = "the scattered dim"
) -> Pending:
    """Launch `reduce_scatter_along_dim`; when dim != 0 or x is not contiguous, x may change at once (its
    pieces were copied), else it must stay unchanged until `wait()`."""
    return _reduce_scatter(x, dim, group, what, True)


def resolve_tp_group(group: ProcessGroup | str | None) -> ProcessGroup:
    """`group` as a handle: None means this rank's TP group; an axis or group name is looked up.

    Call it when a layer or Function is built, on the rank thread, never inside backward.
    """
    return resolve_group(group, "TP")
