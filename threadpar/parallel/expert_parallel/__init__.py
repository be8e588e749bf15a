"""Expert parallelism: a mixture-of-experts layer (top-k router with load-balancing loss, capacity and
dropping, batched experts) whose experts are sharded over an EP group and reached with all-to-all."""

from threadpar.parallel.expert_parallel.config import MoEConfig
from threadpar.parallel.expert_parallel.dispatch import AllToAllDispatcher, all_to_all_rows
from threadpar.parallel.expert_parallel.experts import GroupedExperts
from threadpar.parallel.expert_parallel.groups import allreduce_moe_grads, expert_parameters
from threadpar.parallel.expert_parallel.layer import MoE, MoEStats
from threadpar.parallel.expert_parallel.routing import (
    Routing,
    TopKRouter,
    expert_capacity,
    load_balancing_loss,
)
from threadpar.parallel.groups import expert_groups, expert_parallel_groups

__all__ = [
    "AllToAllDispatcher",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "Routing",
    "TopKRouter",
    "all_to_all_rows",
    "allreduce_moe_grads",
    "expert_capacity",
    "expert_groups",
    "expert_parallel_groups",
    "expert_parameters",
    "load_balancing_loss",
]
