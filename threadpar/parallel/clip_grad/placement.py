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

The placement is a record in the rank's table of parameter records (threadpar.parallel.records: where
Megatron sets `param.tensor_model_parallel`, nothing is set on the Parameter here), kept under the module
and name holding the parameter, so `to_empty` and `load_state_dict(assign=True)` keep it. `grad_placements_of
(module)` derives it from what the layers already record: a TensorParallelModule's `shard_specs` and
`group` (TP layers; GroupedExperts over their EP group), and the launch's layout for everything else (a
parameter outside the TP layers is replicated on every TP rank, as in Megatron). DistributedDataParallel
records the modules it wraps (with its group, and the expert-DP group for sharded experts);
`mark_grad_placements(model)` records a model no DDP wraps. A deep copy is another model: mark it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.groups import data_parallel_group, tensor_parallel_group
from threadpar.parallel.records import GradPlacement, ParamRecord, latest_placements, param_table
from threadpar.runtime.context import get_layout, in_rank

# (qualified name, module, its own parameter's name, the placement or None when it cannot be told)
Placed = tuple[str, nn.Module, str, GradPlacement | None]

HOW_TO_MARK = (
    "mark it: wrap the model in threadpar.parallel.DistributedDataParallel or call "
    "threadpar.parallel.mark_grad_placements(model) on every rank (both mark what the TP layers, the MoE "
    "experts and the layout tell; a deep copy is another model: mark it too); a layer over a group of your "
    "own needs mark_grad_placement(param, GradPlacement(replicated_over=<groups holding identical copies>, "
    "data_parallel=<its DP group>))"
)


def mark_grad_placement(param: torch.Tensor, placement: GradPlacement) -> None:
    """Record where `param`'s gradient sits in the whole model's gradient (see the module docstring), in
    this rank's table. Outside a launch every gradient is the only copy, which clipping assumes there, so
    only GradPlacement() (no groups) can be given and nothing is recorded."""
    if not isinstance(placement, GradPlacement):
        raise TypeError(f"mark_grad_placement takes a GradPlacement, got {type(placement).__name__}")
    if in_rank():
        param_table().add_parameter(param, ParamRecord(placement))


def _same_ranks(a: ProcessGroup, b: ProcessGroup | None) -> bool:
    return b is not None and list(a.ranks) == list(b.ranks)


def mark_grad_placements(
    module: nn.Module,
    *,
    data_parallel: ProcessGroup | None = None,
    expert_data_parallel: ProcessGroup | None = None,
) -> nn.Module:
    """Record every parameter's placement in this rank's table (call on every rank, after the model is
    built; returns it). Outside a launch nothing is recorded: every gradient there is the only copy.

    data_parallel: the group its reduced gradients are identical over (None: this rank's DP group, DP x CP
    under context parallelism). expert_data_parallel: for MoE experts sharded over an EP group, the ranks
    holding the same experts (`expert_groups()[1]`, `expert_parallel_groups(ep)[1]`); needed when those are
    more than one.
    """
    if in_rank():
        table = param_table()
        for _, sub, name, placement in grad_placements_of(module, data_parallel, expert_data_parallel):
            table.add(sub, name, ParamRecord(placement))
    return module


def grad_placements_of(
    module: nn.Module,
    data_parallel: ProcessGroup | None = None,
    expert_data_parallel: ProcessGroup | None = None,
    strict: bool = True,
) -> list[Placed]:
    """(qualified name, module, name, placement) for every parameter of `module` (inside a launch; a shared
    module's under each of its names). strict=False (what
    DistributedDataParallel uses): a placement that cannot be told is None instead of an error (clipping
    that parameter then raises, naming it)."""
    tp = tensor_parallel_group()
    dp = data_parallel_group() if data_parallel is None else data_parallel
    placed: list[Placed] = []
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for name, _ in sub.named_parameters(recurse=False):
            where = f"{module_name}.{name}" if module_name else name
            try:
                placed.append(
                    (where, sub, name, _placement_of(sub, name, where, tp, dp, expert_data_parallel))
                )
            except ConfigError:
                if strict:
                    raise
                placed.append((where, sub, name, None))
    return placed


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
    """Each parameter's placement (its latest record's, in this rank's table); unrecorded ones are distinct
    pieces only when the layout replicates nothing."""
    replicates = _layout_replicates()
    placements = []
    for index, (param, record) in enumerate(zip(params, latest_placements(params))):
        placement = None if record is None else record.placement
        if placement is None:
            if replicates is not None:
                raise ConfigError(
                    f"clip_grad_norm_: parameter #{index} (shape {list(param.shape)}, {param.dtype}) has no "
                    f"gradient placement, and this rank's layout ({replicates}) keeps copies and shards of "
                    f"parameters, so how it counts in the whole model's norm is unknown; {HOW_TO_MARK}"
                )
            placement = GradPlacement()
        placements.append(placement)
    return placements
