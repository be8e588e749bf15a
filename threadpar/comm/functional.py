"""Module-level collectives with torch.distributed's names, argument orders and in-place semantics.

`group=None` is the world; a group may also be given as axes (an axis "TP" or Axis.TP, axes together
("DP", "CP"), an expert axis "EP"/"EDP"), a group name ("TP1", "DPCP0"),
or a ProcessGroup handle. `src`/`dst` are global ranks. Inside autograd Functions and hooks, call the
methods of a captured ProcessGroup instead: these functions look up the calling thread's rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.comm.group import ProcessGroup
from threadpar.comm.rank_groups import current_groups
from threadpar.topology import Axes

GroupLike = ProcessGroup | Axes | None


def _group(group: GroupLike) -> ProcessGroup:
    if isinstance(group, ProcessGroup):
        return group
    return current_groups().group(group)


def new_group(ranks: Sequence[int] | None = None, name: str | None = None) -> ProcessGroup:
    """The group of `ranks` (all ranks when None); the same ranks or name give the same group.

    Unlike torch.distributed, ranks outside the group need not call it. A non-member gets a handle whose
    rank() is -1 and whose collectives raise.
    """
    groups = current_groups()
    ranks = range(groups.source.world_size) if ranks is None else ranks
    return groups.handle(groups.source.groups.get_or_create(ranks, name))


def get_group(group: GroupLike = None) -> ProcessGroup:
    """This rank's group: the world when None, its group on axes (an axis "DP", "TP", "PP", "CP",
    Axis.TP; axes together ("DP", "CP"); the expert axes "EP", "EDP"), the group of that name ("TP1"), or the
    ProcessGroup given."""
    return _group(group)


def get_rank(group: GroupLike = None) -> int:
    """This rank's index in `group` (its global rank for the world, when None; -1 if not a member), like
    torch.distributed.get_rank(group)."""
    if group is None:
        return current_groups().rank
    return _group(group).rank()


def get_world_size(group: GroupLike = None) -> int:
    """The number of ranks in `group` (the world when None), like torch.distributed.get_world_size(group)."""
    if group is None:
        return current_groups().source.world_size
    return _group(group).size()


def all_reduce(
    tensor: torch.Tensor, op=ReduceOp.SUM, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    return _group(group).all_reduce(tensor, op, async_op)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    return _group(group).all_reduce_coalesced(tensors, op, async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: GroupLike = None, async_op: bool = False):
    return _group(group).reduce(tensor, dst, op, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: GroupLike = None, async_op: bool = False) -> Work | None:
    return _group(group).broadcast(tensor, src, async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False
):
    return _group(group).all_gather(tensor_list, tensor, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    return _group(group).all_gather_into_tensor(output_tensor, input_tensor, async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op=ReduceOp.SUM,
    group: GroupLike = None,
    async_op=False,
) -> Work | None:
    return _group(group).reduce_scatter(output, input_list, op, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op=ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
) -> Work | None:
    return _group(group).reduce_scatter_tensor(output, input, op, async_op)


def scatter(
    tensor: torch.Tensor, scatter_list=None, src: int = 0, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    return _group(group).scatter(tensor, scatter_list, src, async_op)


def gather(
    tensor: torch.Tensor, gather_list=None, dst: int = 0, group: GroupLike = None, async_op: bool = False
):
    return _group(group).gather(tensor, gather_list, dst, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group: GroupLike = None, async_op: bool = False):
    return _group(group).all_to_all(output_tensor_list, input_tensor_list, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: GroupLike = None,
    async_op: bool = False,
) -> Work | None:
    return _group(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)


def barrier(group: GroupLike = None, async_op: bool = False) -> Work | None:
    return _group(group).barrier(async_op)


def send(tensor: torch.Tensor, dst: int, group: GroupLike = None, tag: int = 0) -> None:
    _group(group).send(tensor, dst, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: GroupLike = None, tag: int = 0) -> int:
    return _group(group).recv(tensor, src, tag)


def isend(tensor: torch.Tensor, dst: int, group: GroupLike = None, tag: int = 0) -> Work:
    return _group(group).isend(tensor, dst, tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: GroupLike = None, tag: int = 0) -> Work:
    return _group(group).irecv(tensor, src, tag)
