"""Module-level collectives with torch.distributed's names, argument orders and in-place semantics.

Parameter names, order and defaults are torch 2.13's (tests/test_torch_signatures.py compares them).
`group=None` is the world; a group may also be given as axes (an axis "TP" or Axis.TP, axes together
("DP", "CP"), an expert axis "EP"/"EDP"), a group name ("TP1", "DPCP0"), or a ProcessGroup handle.
`src`/`dst` are global ranks, `group_src`/`group_dst` ranks in `group` (one or the other). Inside autograd
Functions and hooks, call the methods of a captured ProcessGroup instead: these functions look up the
calling thread's rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm import torch_args
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.comm.group import ProcessGroup
from threadpar.comm.rank_groups import current_groups
from threadpar.comm.torch_signatures import follows
from threadpar.errors import ConfigError
from threadpar.topology import Axes

GroupLike = ProcessGroup | Axes | None


def _group(group: GroupLike) -> ProcessGroup:
    if isinstance(group, ProcessGroup):
        return group
    return current_groups().group(group)


@follows(dist.new_group)  # torch 2.11 has no sort_ranks
def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
) -> ProcessGroup:
    """The group of `ranks` (all ranks when None), with torch.distributed.new_group's parameters.

    The same ranks give the same group (one set of communicators), unless `timeout` gives the group a wait
    limit other than the launch's: that is a group of its own. `group_desc` names the group, so that
    `get_group("name")` finds it. Ranks outside the group need not call this (torch's
    `use_local_synchronization=True` is how threadpar always works); a non-member gets a handle whose
    rank() is -1 and whose collectives raise. `backend` must be the launch's (or torch's name for it:
    "gloo" for threads, "nccl"); `device_id` this rank's device; `pg_options` None.
    """
    groups = current_groups()
    source = groups.source
    seconds = torch_args.seconds("new_group", timeout)
    torch_args.check_backend("new_group", backend, source.backend, groups.device)
    torch_args.check_device_id("new_group", device_id, groups.device)
    if pg_options is not None:
        raise ConfigError(
            "new_group: pg_options are a torch backend's own options (e.g. ProcessGroupNCCL.Options); threadpar's "
            "groups take none: pass pg_options=None"
        )
    if not isinstance(use_local_synchronization, bool) or not isinstance(sort_ranks, bool):
        raise ConfigError("new_group: use_local_synchronization and sort_ranks must be True or False")
    if group_desc is not None and not isinstance(group_desc, str):
        raise ConfigError(f"new_group: group_desc must be a str (the group's name), got {group_desc!r}")
    ranks = range(source.world_size) if ranks is None else ranks
    if sort_ranks:
        ranks = sorted(ranks)  # as torch: a member's group rank is its place in sorted order
    if seconds == source.timeout:
        seconds = None  # the launch's own: the same group as without a timeout
    return groups.handle(source.groups.get_or_create(ranks, group_desc, seconds))


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


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op=ReduceOp.SUM,
    group: GroupLike = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    pg = _group(group)
    if group_dst is not None or dst is None:  # (the common call, a global rank, skips this)
        dst = torch_args.required_peer("reduce", pg, "dst", dst, group_dst)
    return pg.reduce(tensor, dst, op, async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    pg = _group(group)
    if group_src is not None or src is None:  # (the common call, a global rank, skips this)
        src = torch_args.required_peer("broadcast", pg, "src", src, group_src)
    return pg.broadcast(tensor, src, async_op)


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
    async_op: bool = False,
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
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Neither `src` nor `group_src`: global rank 0, as torch."""
    pg = _group(group)
    root = torch_args.peer("scatter", pg, "src", src, group_src)
    return pg.scatter(tensor, scatter_list, 0 if root is None else root, async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: GroupLike = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Neither `dst` nor `group_dst`: global rank 0, as torch."""
    pg = _group(group)
    root = torch_args.peer("gather", pg, "dst", dst, group_dst)
    return pg.gather(tensor, gather_list, 0 if root is None else root, async_op)


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


@follows(dist.barrier)  # torch 2.11 has no timeout
def barrier(
    group: GroupLike = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: datetime.timedelta | None = None,
) -> Work | None:
    """`device_ids`: on a CUDA rank, [its device index] (or None); `timeout`: how long each rank waits for
    the others (the launch's when None); its error names the ranks that did not arrive."""
    groups = current_groups()
    if device_ids is not None:
        torch_args.check_device_ids("barrier", device_ids, groups.device)
    pg = group if isinstance(group, ProcessGroup) else groups.group(group)
    return pg.barrier(async_op, None if timeout is None else torch_args.seconds("barrier", timeout))


def monitored_barrier(
    group: GroupLike = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that fails after `timeout` (the launch's when None) with an error naming every rank that
    did not arrive; threadpar always names all of them (torch's `wait_all_ranks=True`). Unlike torch's,
    which only gloo implements, it works on every backend."""
    if not isinstance(wait_all_ranks, bool):
        raise ConfigError(f"monitored_barrier: wait_all_ranks must be True or False, got {wait_all_ranks!r}")
    _group(group).barrier(False, torch_args.seconds("monitored_barrier", timeout))


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: GroupLike = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    pg = _group(group)
    if group_dst is not None or dst is None:  # (the common call, a global rank, skips this)
        dst = torch_args.required_peer("send", pg, "dst", dst, group_dst)
    pg.send(tensor, dst, tag)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupLike = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Neither `src` nor `group_src`: from any member. Returns the sender's global rank."""
    pg = _group(group)
    if group_src is not None:
        src = torch_args.peer("recv", pg, "src", src, group_src)
    return pg.recv(tensor, src, tag)


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: GroupLike = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work:
    pg = _group(group)
    if group_dst is not None or dst is None:  # (the common call, a global rank, skips this)
        dst = torch_args.required_peer("isend", pg, "dst", dst, group_dst)
    return pg.isend(tensor, dst, tag)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: GroupLike = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work:
    """Neither `src` nor `group_src`: from any member."""
    pg = _group(group)
    if group_src is not None:
        src = torch_args.peer("irecv", pg, "src", src, group_src)
    return pg.irecv(tensor, src, tag)
