"""Where a rank's gradient tensor sits in the whole model's gradient: the marker that clipping reads.

A rank holds pieces of the model's gradient. A piece is either distinct (a TP shard, an EP shard of the
experts, the layers of a pipeline stage: summed into the norm) or one of several identical copies (a
LayerNorm weight on every TP rank, every parameter on every DP replica once gradients are reduced: counted
once). `GradPlacement` names the groups whose members hold identical copies; the copy on each group's
first member is the one that counts.

    ColumnParallelLinear.weight (TP shard)  GradPlacement(replicated_over=(), data_parallel=DP)
    LayerNorm.weight in a TP model          GradPlacement(replicated_over=(TP,), data_parallel=DP)
    RowParallelLinear.bias, SP-marked norms GradPlacement(replicated_over=(TP,), data_parallel=DP)
    MoE experts sharded over EP             GradPlacement(replicated_over=(TP,), data_parallel=expert-DP)

The marker is an attribute of the Parameter (`param.grad_placement`, as Megatron marks
`param.tensor_model_parallel`). `mark_grad_placements(module)` derives it from what the layers already
record: a TensorParallelModule's `shard_specs` and `group` (TP layers; GroupedExperts over their EP
group), and the launch's layout for everything else (a parameter outside the TP layers is replicated on
every TP rank, as in Megatron). DistributedDataParallel marks the modules it wraps (with its group, and
the expert-DP group for sharded experts); mark a model yourself when no DDP wraps it. torch's
Parameter.__deepcopy__ and `to_empty` make new Parameter objects without the marker: mark after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from threadpar.comm.functional import get_group
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.runtime.context import get_layout, in_rank

PLACEMENT_ATTR = "grad_placement"  # on a Parameter: its GradPlacement

HOW_TO_MARK = (
    "mark it: wrap the model in threadpar.parallel.DistributedDataParallel or call "
    "threadpar.parallel.mark_grad_placements(model) on every rank (both mark what the TP layers, the MoE "
    "experts and the layout tell; mark again after to_empty, deepcopy or load_state_dict(assign=True), which "
    "make new Parameters); a layer over a group of your own needs mark_grad_placement(param, "
    "GradPlacement(replicated_over=<groups holding identical copies>, data_parallel=<its DP group>))"
)


@dataclass(frozen=True, eq=False)
class GradPlacement:
    """The groups whose members hold an identical copy of this rank's gradient tensor.

    replicated_over: model-parallel groups (e.g. TP for a LayerNorm weight or an SP-replicated bias).
    data_parallel: the group over which the reduced gradient is identical (DDP's group; the expert-DP
        group for experts sharded over EP); None when no other rank holds a copy.
    A ZeRO optimizer that keeps 1/dp of the reduced gradient per rank uses `sharded_over_data_parallel()`.
    """

    replicated_over: tuple[ProcessGroup, ...] = ()
    data_parallel: ProcessGroup | None = None

    def __post_init__(self) -> None:
        groups = (*self.replicated_over, *([self.data_parallel] if self.data_parallel is not None else []))
        for group in groups:
            if not isinstance(group, ProcessGroup):
                raise ConfigError(f"GradPlacement takes ProcessGroup handles, got {type(group).__name__}")
            if not group.is_member():
                raise ConfigError(
                    f"GradPlacement: rank {group.global_rank} is not in group '{group.name}' "
                    f"{list(group.ranks)}; name the groups this rank's copy is shared in"
                )

    @property
    def counted(self) -> bool:
        """Whether this rank's copy is the one that counts (the first member of every replica group)."""
        groups = (*self.replicated_over, *([self.data_parallel] if self.data_parallel is not None else []))
        return all(group.rank() == 0 for group in groups)

    def sharded_over_data_parallel(self) -> GradPlacement:
        """The placement of this rank's 1/dp slice of the reduced gradient (ZeRO-2): the slices of the
        DP ranks are distinct pieces, so only the model-parallel copies remain."""
        return replace(self, data_parallel=None)


def mark_grad_placement(param: torch.Tensor, placement: GradPlacement) -> None:
    """Record where `param`'s gradient sits in the whole model's gradient (see the module docstring)."""
    if not isinstance(placement, GradPlacement):
        raise TypeError(f"mark_grad_placement takes a GradPlacement, got {type(placement).__name__}")
    setattr(param, PLACEMENT_ATTR, placement)


def _tp_group() -> ProcessGroup | None:
    return get_group("TP") if get_layout().tp > 1 else None


def _default_data_parallel() -> ProcessGroup:
    from threadpar.parallel.ddp.distributed import default_group

    return default_group()


def _same_ranks(a: ProcessGroup, b: ProcessGroup | None) -> bool:
    return b is not None and list(a.ranks) == list(b.ranks)


def mark_grad_placements(
    module: nn.Module,
    *,
    data_parallel: ProcessGroup | None = None,
    expert_data_parallel: ProcessGroup | None = None,
    strict: bool = True,
) -> nn.Module:
    """Mark every parameter of `module` (call on every rank, after the model is built; returns it).

    data_parallel: the group its reduced gradients are identical over (None: this rank's DP group, DP x CP
    under context parallelism). expert_data_parallel: for MoE experts sharded over an EP group, the ranks
    holding the same experts (`expert_parallel_groups(ep)[1]`); needed when those are more than one.
    strict=False (what DistributedDataParallel uses): leave a parameter whose placement cannot be told
    unmarked instead of raising; clipping it then raises, naming it.
    """
    if not in_rank():  # a plain model on one thread: every tensor is the only copy
        for param in module.parameters():
            mark_grad_placement(param, GradPlacement())
        return module
    tp = _tp_group()
    dp = _default_data_parallel() if data_parallel is None else data_parallel
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub.named_parameters(recurse=False):
            where = f"{module_name}.{name}" if module_name else name
            try:
                mark_grad_placement(param, _placement_of(sub, name, where, tp, dp, expert_data_parallel))
            except ConfigError:
                if strict:
                    raise
                if hasattr(param, PLACEMENT_ATTR):
                    delattr(param, PLACEMENT_ATTR)  # a stale marker would be worse than none
    return module


def _placement_of(
    sub: nn.Module,
    name: str,
    where: str,
    tp: ProcessGroup | None,
    dp: ProcessGroup,
    expert_data_parallel: ProcessGroup | None,
) -> GradPlacement:
    from threadpar.parallel.expert_parallel.experts import GroupedExperts
    from threadpar.parallel.tensor_parallel.sharding import TensorParallelModule

    on_tp = () if tp is None else (tp,)
    dense_dp = dp if dp.size() > 1 else None
    if isinstance(sub, GroupedExperts) and sub.group is not None and sub.ep_size > 1:
        # Each TP rank holds its EP shard's experts whole; the same experts sit on the expert-DP ranks.
        expert_dp = expert_data_parallel
        if expert_dp is None and dp.size() > sub.ep_size:
            raise ConfigError(
                f"mark_grad_placements: '{where}' is an expert sharded over EP group {list(sub.group.ranks)}, "
                f"and {dp.size() // sub.ep_size} ranks of data-parallel group '{dp.name}' hold the same "
                "experts; pass expert_data_parallel=expert_parallel_groups(ep)[1] (or wrap the model in "
                "DistributedDataParallel)"
            )
        return GradPlacement(on_tp, expert_dp if expert_dp is not None and expert_dp.size() > 1 else None)
    if isinstance(sub, TensorParallelModule) and sub.group is not None and sub.tp_size > 1:
        if not _same_ranks(sub.group, tp):
            raise ConfigError(
                f"mark_grad_placements: '{where}' belongs to a {type(sub).__name__} over group "
                f"'{sub.group.name}' {list(sub.group.ranks)}, not this rank's TP group, so which ranks hold "
                "copies of it is unknown; mark it yourself: mark_grad_placement(param, GradPlacement("
                "replicated_over=<groups holding identical copies>, data_parallel=<DP group>))"
            )
        sharded = name in sub.shard_specs  # else replicated on the layer's TP ranks (a row bias)
        return GradPlacement(() if sharded else on_tp, dense_dp)
    return GradPlacement(
        on_tp, dense_dp
    )  # outside the TP layers: the same on every TP rank (Megatron's default)


def _layout_replicates() -> str | None:
    """A description of the layout's replication (None when no rank holds a copy of another's tensors)."""
    if not in_rank():
        return None
    layout = get_layout()
    if layout.tp == 1 and layout.dp * layout.cp == 1:
        return None  # only pipeline stages: every rank's parameters are distinct
    return f"dp={layout.dp}, cp={layout.cp}, tp={layout.tp}, pp={layout.pp}"


def grad_placements(params: Sequence[torch.Tensor]) -> list[GradPlacement]:
    """Each parameter's marker; unmarked ones are distinct pieces only when the layout replicates nothing."""
    replicates = _layout_replicates()
    placements = []
    for index, param in enumerate(params):
        placement = getattr(param, PLACEMENT_ATTR, None)
        if placement is None:
            if replicates is not None:
                raise ConfigError(
                    f"clip_grad_norm_: parameter #{index} (shape {list(param.shape)}, {param.dtype}) has no "
                    f"gradient placement, and this rank's layout ({replicates}) keeps copies and shards of "
                    f"parameters, so how it counts in the whole model's norm is unknown; {HOW_TO_MARK}"
                )
            placement = GradPlacement()
        elif not isinstance(placement, GradPlacement):
            raise ConfigError(
                f"clip_grad_norm_: parameter #{index} has a '{PLACEMENT_ATTR}' attribute of type "
                f"{type(placement).__name__}; it must be a GradPlacement (use mark_grad_placement)"
            )
        placements.append(placement)
    return placements
