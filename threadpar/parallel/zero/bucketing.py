"""Which group each parameter is sharded over, and the buckets the distributed optimizer splits.

A parameter is sharded over the group DDP averages its gradient over (DP, DP x CP, or expert-DP for MoE
experts sharded over an EP group: DDP's records, threadpar.parallel.records), or over an explicit
`process_group`.
Parameters in one of DDP's buckets keep that bucket (so ZeRO-2 can take its reduction over); the others
are bucketed here by size, per (group, device, dtype), in reverse order as DDP does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.ddp.bucketing import MIB, TensorSpec, assign_buckets
from threadpar.parallel.ddp.reducer import Reducer
from threadpar.parallel.records import ParamRecord, owner_records
from threadpar.parallel.zero.shard_bucket import ShardBucket

LEFTOVER_BUCKET_BYTES = 25 * MIB  # DDP's default bucket_cap_mb


def _describe(group: ProcessGroup) -> str:
    return f"'{group.name}' {list(group.ranks)}"


def _owner(
    owners: list[ParamRecord], name: str, process_group: ProcessGroup | None
) -> tuple[ProcessGroup, Reducer | None]:
    groups = {tuple(g.ranks): g for g in (o.group for o in owners) if g is not None}
    first = next(iter(groups.values()), None)
    if len(groups) > 1:
        listed = " and ".join(_describe(g) for g in groups.values())
        raise ConfigError(
            f"ZeroRedundancyOptimizer: parameter {name} is reduced by DDP over two different groups, {listed}; "
            "wrap each module in one DistributedDataParallel only"
        )
    if process_group is not None:
        if first is not None and tuple(first.ranks) != tuple(process_group.ranks):
            raise ConfigError(
                f"ZeroRedundancyOptimizer: parameter {name} has its gradient averaged by DDP over group "
                f"{_describe(first)}, but the optimizer was given process_group "
                f"{_describe(process_group)}: one optimizer would shard over two different DP groups. Pass "
                "process_group=None (each parameter is sharded over its own DDP group, MoE experts included)"
            )
        return process_group, owners[0].reducer if owners else None
    if first is None:
        raise ConfigError(
            f"ZeroRedundancyOptimizer: parameter {name} belongs to no group the optimizer can shard over: no "
            "DistributedDataParallel wraps it. Wrap its module in DistributedDataParallel (its group is then "
            "used), or pass process_group (e.g. process_group='DP')"
        )
    return first, owners[0].reducer


def build_shard_buckets(
    params: Sequence[torch.nn.Parameter],
    names: Sequence[str],
    process_group: ProcessGroup | None,
    stage: int,
) -> tuple[list[ShardBucket], list[Reducer]]:
    """The buckets over `params` (each parameter in exactly one), and for stage 2 the reducers whose
    reductions the optimizer takes over. Raises ConfigError before anything changes."""
    owner = {
        id(p): _owner(records, n, process_group)
        for p, n, records in zip(params, names, owner_records(params))
    }
    name_of = {id(p): n for p, n in zip(params, names)}
    mine = set(owner)
    buckets: list[ShardBucket] = []
    reducers: list[Reducer] = []
    placed: set[int] = set()
    for p in params:
        reducer = owner[id(p)][1]
        if reducer is None or any(r is reducer for r in reducers):
            continue
        reducers.append(reducer)
        reducer_params = reducer.parameters
        missing = [n for q, n in zip(reducer_params, reducer.parameter_names) if id(q) not in mine]
        if stage == 2 and missing:
            raise ConfigError(
                f"ZeroRedundancyOptimizer(stage=2): DDP reduce-scatters a whole module's gradients into the "
                f"optimizer's shards, but {len(missing)} of its parameters are not in this optimizer "
                f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); give the optimizer all of them, "
                "or use stage=1"
            )
        for k, members in enumerate(reducer.bucket_indices()):
            bucket_params = [reducer_params[i] for i in members if id(reducer_params[i]) in mine]
            if bucket_params:
                buckets.append(ShardBucket(reducer.group, bucket_params, k))
                placed.update(id(q) for q in bucket_params)
    leftover = [p for p in params if id(p) not in placed]
    if stage == 2:
        unreduced = [p for p in leftover if p.requires_grad and owner[id(p)][0].size() > 1]
        if unreduced:
            raise ConfigError(
                f"ZeroRedundancyOptimizer(stage=2) reduce-scatters gradients inside DDP's backward, but no "
                f"DistributedDataParallel reduces parameter {name_of[id(unreduced[0])]}"
                f"{f' and {len(unreduced) - 1} more' if len(unreduced) > 1 else ''}; wrap their module in "
                "DistributedDataParallel, or use stage=1"
            )
    by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for p in leftover:
        by_group.setdefault(tuple(owner[id(p)][0].ranks), []).append(p)
    for group_params in by_group.values():
        group = owner[id(group_params[0])][0]
        specs = [TensorSpec(p.numel() * p.element_size(), (str(p.device), p.dtype)) for p in group_params]
        for members in assign_buckets(specs, [LEFTOVER_BUCKET_BYTES]):
            buckets.append(ShardBucket(group, [group_params[i] for i in members]))
    return buckets, reducers if stage == 2 else []
