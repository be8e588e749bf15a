"""Each wrapper's record of the parameters it holds: the group their gradient is averaged over, where that
gradient sits in the whole model's gradient, and the bucket that reduces it.

DistributedDataParallel records every parameter it wraps (`DistributedDataParallel.param_records`, and the
rank's table: `RankContext.params`); `mark_grad_placements` records placements for a model no DDP wraps.
ZeRO reads the owner records (which group to shard a parameter over, which reducer's buckets to take
over) and at stage 2 records itself as the holder of the gradients it keeps (GradHolder); clipping reads
the placements. All look them up through the rank's context, never through an attribute of the Parameter
or a module global (DESIGN.md rule 1). As Megatron hands DDP's buffers to its
distributed optimizer, the records are explicit objects a caller may also pass around.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.runtime.context import current, in_rank
from threadpar.runtime.param_table import ParamTable

if TYPE_CHECKING:
    from threadpar.parallel.ddp.reducer import Reducer


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


@dataclass(frozen=True)
class ParamRecord:
    """What one wrapper records about one parameter.

    placement: where its gradient sits in the whole model's gradient (None: unknown, clipping raises).
    group: the group a DistributedDataParallel averages its gradient over (None: no DDP reduces it).
    reducer: that DDP's Reducer (None without one: a group of one rank), held weakly.
    """

    placement: GradPlacement | None
    group: ProcessGroup | None = None
    _reducer: weakref.ReferenceType | None = None  # weak: the reducer holds the parameter

    @classmethod
    def of_ddp(
        cls, placement: GradPlacement | None, group: ProcessGroup, reducer: Reducer | None
    ) -> ParamRecord:
        return cls(placement, group, None if reducer is None else weakref.ref(reducer))

    @property
    def reducer(self) -> Reducer | None:
        return None if self._reducer is None else self._reducer()

    def bucket(self, param: torch.Tensor) -> int | None:
        """The index of the reducer's bucket that holds `param` now (buckets are rebuilt after the first
        backward), or None without a reducer or for a parameter it does not reduce (a frozen one)."""
        reducer = self.reducer
        index = (
            None
            if reducer is None
            else next((i for i, p in enumerate(reducer.parameters) if p is param), None)
        )
        if reducer is None or index is None:
            return None
        return next(k for k, members in enumerate(reducer.bucket_indices()) if index in members)


@dataclass(frozen=True)
class SequenceParallelMark:
    """The parameter is replicated on the TP ranks but applied to sequence shards: its gradient is summed
    over TP (threadpar.parallel.tensor_parallel.sequence_parallel)."""


@dataclass(frozen=True)
class GradHolder:
    """The parameter's gradient is kept by `holder` (a ZeRO-2 shard), not in `param.grad`
    (threadpar.parallel.grad_holder says why that matters)."""

    holder: weakref.ReferenceType  # weak: once the holder is gone the parameter is an ordinary one again
    description: str  # e.g. "ZeroRedundancyOptimizer(stage=2)"
    instead: str  # what to call instead, for each function that reads param.grad (a sentence)


Record = ParamRecord | SequenceParallelMark | GradHolder


def param_table() -> ParamTable[Record]:
    """This rank's table of parameter records (its RankContext's)."""
    return current().params


def records_of(params: Sequence[torch.Tensor]) -> list[tuple[Record, ...]]:
    """Each parameter's records in this rank's table, oldest first; none outside a launch."""
    if not in_rank():
        return [() for _ in params]
    return param_table().records(params)


def owner_records(params: Iterable[torch.Tensor]) -> list[list[ParamRecord]]:
    """Each parameter's DDP records (those with a group), oldest first."""
    return [
        [r for r in found if isinstance(r, ParamRecord) and r.group is not None]
        for found in records_of(list(params))
    ]


def latest_placements(params: Sequence[torch.Tensor]) -> list[ParamRecord | None]:
    """Each parameter's latest record that says where its gradient sits (DDP's or mark_grad_placements'),
    None when it has none."""
    return [
        next((r for r in reversed(found) if isinstance(r, ParamRecord)), None) for found in records_of(params)
    ]
