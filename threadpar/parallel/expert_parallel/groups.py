"""Expert-parallel groups carved out of the data-parallel group, and the gradient sums they need.

With dp data-parallel replicas and ep experts groups of size ep (ep divides dp), DP rank i is in EP group
i // ep (ep consecutive DP ranks, which split the experts) and in expert-data-parallel group i % ep (the
dp / ep ranks that hold the same experts and whose expert gradients must be summed).

    dp = 4, ep = 2:  EP groups [d0 d1] [d2 d3];  expert-DP groups [d0 d2] [d1 d3]
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.expert_parallel.experts import GroupedExperts
from threadpar.parallel.groups import allreduce_grads, resolve_group


def expert_parallel_groups(
    ep: int, dp_group: ProcessGroup | str | None = None
) -> tuple[ProcessGroup, ProcessGroup]:
    """(EP group, expert-data-parallel group) of this rank, carved out of its DP group. Every rank calls it."""
    from threadpar.comm.functional import new_group

    dp = resolve_group(dp_group, "DP")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp.size() % ep:
        raise ConfigError(
            f"ep={ep!r} must be a positive int that divides the data-parallel size {dp.size()} "
            f"(the experts are split over ep of the {dp.size()} DP replicas)"
        )
    i = dp.rank()
    start = i // ep * ep
    expert = new_group(dp.ranks[start : start + ep], sort_ranks=False)
    return expert, new_group(dp.ranks[i % ep :: ep], sort_ranks=False)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of every GroupedExperts in `module` (sharded over an EP group, not replicated)."""
    return [p for sub in module.modules() if isinstance(sub, GroupedExperts) for p in sub.parameters()]


def allreduce_moe_grads(
    module: nn.Module,
    dp_group: ProcessGroup | str | None = None,
    expert_dp_group: ProcessGroup | None = None,
    params: Iterable[nn.Parameter] | None = None,
) -> None:
    """Sum gradients for a model with MoE layers: expert parameters over `expert_dp_group` (the ranks
    holding the same experts; None: no other rank does, as when ep = dp), the rest over `dp_group`.
    For training without DDP (DistributedDataParallel does this itself, averaging); divide by dp afterwards
    for a mean."""
    experts = {id(p) for p in expert_parameters(module)}
    params = list(module.parameters() if params is None else params)
    allreduce_grads([p for p in params if id(p) not in experts], resolve_group(dp_group, "DP"))
    if expert_dp_group is not None:
        allreduce_grads([p for p in params if id(p) in experts], expert_dp_group)
