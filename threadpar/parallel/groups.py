"""Which group: the one place the parallel wrappers resolve their `group=` arguments and default groups.

Every group here is a group of the launch's layout (threadpar.topology: an axis, axes together, the expert
dims EP/EDP borrowed from DP x CP) or is computed from given groups by rank arithmetic; none is discovered
by a collective, so a wrapper may be built on any subset of ranks in any order. `group=None` means this
rank's group on the wrapper's own axis (TP for the tensor-parallel layers, CP for ring attention, PP for the
pipeline, DP, or DP x CP under context parallelism, for DDP). Resolve groups when a layer or autograd
Function is built, on the rank thread, never inside backward (DESIGN.md rule 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from threadpar.comm.functional import get_group, new_group
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.grad_holder import check_grads_in_params
from threadpar.runtime.context import get_layout
from threadpar.topology import DATA_AXES, Axes, Axis, Layout, axes_label, parse_axes

GroupArg = ProcessGroup | Axes | None


def resolve_group(group: GroupArg, axes: Axes, who: str = "") -> ProcessGroup:
    """`group` as a handle: None means this rank's group on `axes`; a axes or group name is looked up.
    `who` (e.g. "PipelineParallel") starts the error message of a group this rank is not in."""
    if isinstance(group, ProcessGroup):
        handle = group
    elif group is None or isinstance(group, (str, tuple)):
        handle = get_group(axes if group is None else group)
    else:
        raise TypeError(
            f"group must be None (this rank's {_label(axes)} group), axes or group name, or a "
            f"ProcessGroup; got {group!r}"
        )
    if not handle.is_member():
        raise ConfigError(
            f"{who + ': ' if who else ''}rank {handle.global_rank} is not a member of group '{handle.name}' "
            f"{list(handle.ranks)}; pass a group this rank belongs to (None means its own {_label(axes)} group)"
        )
    return handle


def _label(axes: Axes) -> str:
    return axes_label(parse_axes(axes))


def data_parallel_group() -> ProcessGroup:
    """DistributedDataParallel's default: this rank's DP group; with context parallelism its DP x CP group
    (the ranks it shares TP and PP coordinates with), over which Megatron averages gradients too."""
    return get_group(DATA_AXES if get_layout().cp > 1 else "DP")


def data_context_parallel_group() -> ProcessGroup:
    """This rank's DP x CP group ("DPCP<id>"): the ranks that share its TP and PP coordinates (replicas of
    the same model shard that see different tokens)."""
    return get_group(DATA_AXES)


def context_tensor_parallel_group() -> ProcessGroup:
    """This rank's CP x TP group ("CPTP<id>"): the ranks that share its DP and PP coordinates, which under
    sequence parallelism together hold each of its sequences (a MoE counts routing over them)."""
    return get_group(("CP", "TP"))


def tensor_parallel_group() -> ProcessGroup | None:
    """This rank's TP group, or None when the layout has no tensor parallelism."""
    return get_group("TP") if get_layout().tp > 1 else None


def routing_group(
    tp: ProcessGroup | None, sequence_parallel: bool, cp: ProcessGroup | None
) -> ProcessGroup | None:
    """The ranks holding the other tokens of this rank's sequences (CP, and TP under sequence parallelism),
    over which a MoE counts routing for its load-balancing loss; None: whole sequences are here."""
    sp = tp is not None and sequence_parallel
    if cp is None:
        return tp if sp else None
    return context_tensor_parallel_group() if sp else cp


def expert_groups(ep: int | None = None) -> tuple[ProcessGroup, ProcessGroup]:
    """(EP group, expert-data-parallel group) of this rank, borrowed from its DP x CP group as the layout
    borrows them (threadpar.topology). ep=None: the launch's `ep`, whose groups are named "EP<id>" and
    "EDP<id>"; another ep gives the same arithmetic over unnamed groups."""
    layout = get_layout()
    if ep is None or ep == layout.ep:
        return get_group("EP"), get_group("EDP")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or (layout.dp * layout.cp) % ep:
        raise ConfigError(
            f"ep={ep!r} must be a positive int that divides dp*cp = {layout.dp * layout.cp} (the experts are "
            f"split over ep of the ranks that share a model shard)"
        )
    other = replace(layout, ep=ep)
    rank = get_group().rank()
    return new_group(other.group_ranks("EP", rank)), new_group(other.group_ranks("EDP", rank))


def expert_parallel_groups(
    ep: int, dp_group: ProcessGroup | str | None = None
) -> tuple[ProcessGroup, ProcessGroup]:
    """(EP group, expert-data-parallel group) of this rank, carved out of `dp_group` (None: its DP group):
    DP rank i is in EP group i // ep (ep consecutive ranks, which split the experts) and in expert-DP group
    i % ep (the dp / ep ranks that hold the same experts). Every rank calls it; no collective runs.

        dp = 4, ep = 2:  EP groups [d0 d1] [d2 d3];  expert-DP groups [d0 d2] [d1 d3]
    """
    dp = resolve_group(dp_group, "DP")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp.size() % ep:
        raise ConfigError(
            f"ep={ep!r} must be a positive int that divides the data-parallel size {dp.size()} "
            f"(the experts are split over ep of the {dp.size()} DP replicas)"
        )
    return _carve(dp.ranks, dp.rank(), ep)


def _carve(ranks: Sequence[int], place: int, ep: int) -> tuple[ProcessGroup, ProcessGroup]:
    start = place // ep * ep
    # In the order of the group they are carved from, on every member alike (not sorted).
    return new_group(ranks[start : start + ep], sort_ranks=False), new_group(
        ranks[place % ep :: ep], sort_ranks=False
    )


def expert_data_parallel_group(ep_group: ProcessGroup, group: ProcessGroup) -> ProcessGroup:
    """The members of `group` (DDP's) that hold the same experts as this rank, whose experts are sharded
    over `ep_group`, found by rank arithmetic (no collective):
    - the launch's EDP group, when these are its EP and DP x CP groups (or those of another ep);
    - when both are groups of layout axes (experts over DP, DDP over DP x CP), the group of the axes of
      `group` that `ep_group` lacks (there CP);
    - when `ep_group` is a run of consecutive members of `group` (as expert_parallel_groups carves it), the
      members at the same place of every run."""
    layout, rank = get_layout(), group.global_rank
    ep, ranks, ep_ranks = ep_group.size(), list(group.ranks), list(ep_group.ranks)
    outside = [r for r in ep_ranks if r not in ranks]
    if outside:
        raise ConfigError(
            f"DistributedDataParallel: the experts are sharded over EP group {ep_ranks}, but ranks "
            f"{outside} of it are not in DDP's group '{group.name}' {ranks}; carve the EP group out of the "
            "data-parallel group (launch(ep=...) or expert_parallel_groups(ep)), or pass expert_process_group"
        )
    if group.size() % ep:
        raise ConfigError(
            f"DistributedDataParallel: the EP group of size {ep} does not split DDP's group '{group.name}' of "
            f"{group.size()} ranks evenly; give every member an EP group of a size that divides it"
        )
    if ep_ranks == ranks:
        return new_group([rank])  # every expert's only copy is here
    for ep_size in sorted({layout.ep, ep}):
        if (layout.dp * layout.cp) % ep_size:
            continue
        plane = replace(layout, ep=ep_size)
        if ranks == plane.group_ranks(DATA_AXES, rank) and ep_ranks == plane.group_ranks("EP", rank):
            return get_group("EDP") if ep_size == layout.ep else new_group(plane.group_ranks("EDP", rank))
    for outer in _axes_with_group(layout, ranks, rank):
        for inner in _axes_with_group(layout, ep_ranks, rank):
            if set(inner) < set(outer):
                return get_group(tuple(a for a in outer if a not in inner))
    place = ranks.index(ep_ranks[0])
    if place % ep or ranks[place : place + ep] != ep_ranks:
        raise ConfigError(
            f"DistributedDataParallel: EP group {ep_ranks} is neither a group of the layout inside DDP's group "
            f"'{group.name}' {ranks} nor a run of its consecutive members, so which members hold the same "
            "experts is unknown; carve it with launch(ep=...) or expert_parallel_groups(ep), or pass "
            "expert_process_group"
        )
    return new_group(ranks[ranks.index(rank) % ep :: ep], sort_ranks=False)  # in the order of `group`


def _axes_with_group(layout: Layout, ranks: list[int], rank: int) -> list[tuple[Axis, ...]]:
    """Every set of axes whose group through `rank` is exactly `ranks`."""
    subsets = [tuple(a for i, a in enumerate(Axis) if mask >> i & 1) for mask in range(1, 1 << len(Axis))]
    return [axes for axes in subsets if layout.group_ranks(axes, rank) == ranks]


def allreduce_grads(params: Iterable[torch.nn.Parameter], group: ProcessGroup) -> None:
    """Sum the gradients of `params` over `group`: one coalesced all-reduce per dtype, in the same order on
    every member. Parameters without a gradient are skipped (every member must skip the same ones)."""
    params = list(params)
    check_grads_in_params(params, "allreduce_grads")
    if group.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for dtype in sorted(by_dtype, key=str):
        group.all_reduce_coalesced(by_dtype[dtype])
