"""MoE experts under DistributedDataParallel: parameters sharded over an EP group are not replicas.

Expert parallelism is carved out of data parallelism: the ep ranks of an EP group each hold E / ep of the
experts and compute them for the tokens of the whole EP group. So an expert's gradient on one rank already
sums the tokens of ep replicas, and the ranks that hold the *same* experts are the members of DDP's group
at the same EP rank (the expert-data-parallel group). DDP sums expert gradients over that group and divides
by the size of its own group, so every parameter ends with the gradient of the mean over the whole group's
batch (Megatron's expert gradient scaling: expert-DP size / DP size, then an average over expert-DP).

    DDP group [d0 d1 d2 d3], ep = 2:  EP groups [d0 d1] [d2 d3];  expert-DP groups [d0 d2] [d1 d3]

threadpar.parallel.groups.expert_data_parallel_group finds that group by rank arithmetic.

With ep = 1 (every expert on every rank) the experts are ordinary replicas and DDP treats them so.
"""

from __future__ import annotations

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.expert_parallel.experts import GroupedExperts


def sharded_experts(module: nn.Module) -> list[GroupedExperts]:
    """The GroupedExperts in `module` whose experts are split over an EP group of more than one rank."""
    return [sub for sub in module.modules() if isinstance(sub, GroupedExperts) and sub.ep_size > 1]


def experts_group(experts: list[GroupedExperts]) -> ProcessGroup:
    """The one EP group the experts of a module are sharded over."""
    ep = experts[0].group
    if any(list(e.group.ranks) != list(ep.ranks) for e in experts):
        raise ConfigError(
            "DistributedDataParallel: the MoE layers of this module shard their experts over different EP "
            "groups; use one EP group for the whole module (launch(ep=...) and expert_groups()), or pass "
            "expert_process_group"
        )
    return ep


def expert_parameter_ids(module: nn.Module) -> set[int]:
    return {id(p) for experts in sharded_experts(module) for p in experts.parameters()}
