"""The gradient sums a model with sharded MoE experts needs without DDP.

The expert groups themselves (EP and expert-DP, from the launch's `ep` or carved out of a DP group) come
from threadpar.parallel.groups: `expert_groups`, `expert_parallel_groups`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.parallel.expert_parallel.experts import GroupedExperts
from threadpar.parallel.groups import allreduce_grads, resolve_group


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
