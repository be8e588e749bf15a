"""Gradients under context parallelism: every CP rank holds the whole model and a part of each sequence.

So, as for data parallelism, each rank's parameter gradients are its part's share, and their sum over
the CP group is the gradient of the whole sequence's loss (Megatron all-reduces gradients over the
combined data x context-parallel group). With a loss that is a sum over tokens divided by the whole
sequence's token count, summing is exact; `data_context_parallel_group` (threadpar.parallel.groups) gives
the DP x CP group for a gradient all-reduce that covers both axes at once.
"""

from __future__ import annotations

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.parallel.groups import allreduce_grads, resolve_group


def allreduce_context_parallel_grads(module: nn.Module, group: ProcessGroup | str | None = None) -> None:
    """Sum every parameter gradient of `module` over the CP group (after backward, on every CP rank)."""
    allreduce_grads(module.parameters(), resolve_group(group, "CP"))
