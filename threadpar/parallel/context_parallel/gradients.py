"""Gradients under context parallelism: every CP rank holds the whole model and a part of each sequence.

So, as for data parallelism, each rank's parameter gradients are its part's share, and their sum over
the CP group is the gradient of the whole sequence's loss (Megatron all-reduces gradients over the
combined data x context-parallel group). With a loss that is a sum over tokens divided by the whole
sequence's token count, summing is exact; `data_context_parallel_group` gives the DP x CP group for a
gradient all-reduce that covers both axes at once.
"""

from __future__ import annotations

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.parallel.groups import allreduce_grads, resolve_group


def allreduce_context_parallel_grads(module: nn.Module, group: ProcessGroup | str | None = None) -> None:
    """Sum every parameter gradient of `module` over the CP group (after backward, on every CP rank)."""
    allreduce_grads(module.parameters(), resolve_group(group, "CP"))


def _group_sharing(axes: tuple[str, ...], name: str) -> ProcessGroup:
    """The ranks whose coordinates on `axes` equal this rank's (a group; call on every rank of the launch)."""
    from threadpar.comm.functional import new_group
    from threadpar.runtime.context import current

    ctx = current()
    layout, mine = ctx.world.layout, ctx.coords
    ranks = [r for r in range(layout.world_size) if all(layout.coords_of(r)[a] == mine[a] for a in axes)]
    return new_group(ranks, group_desc=f"{name}{ranks[0]}")


def data_context_parallel_group() -> ProcessGroup:
    """This rank's DP x CP group: the ranks that share its TP and PP coordinates (replicas of the same
    model shard that see different tokens). Call on every rank of the launch."""
    return _group_sharing(("TP", "PP"), "DPCP")


def context_tensor_parallel_group() -> ProcessGroup:
    """This rank's CP x TP group: the ranks that share its DP and PP coordinates, which under sequence
    parallelism together hold each of its sequences (a MoE counts routing over them)."""
    return _group_sharing(("DP", "PP"), "CPTP")
