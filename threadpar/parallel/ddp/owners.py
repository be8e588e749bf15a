"""Which DistributedDataParallel reduces a parameter's gradient, and over which group (for ZeRO).

DDP records every parameter of the module it wraps here: replicated parameters with its group and
reducer, sharded MoE experts with their expert-DP group and reducer. The distributed optimizer reads it to
shard each parameter over the group its gradient is reduced over, and for ZeRO-2 to take over that
reducer's buckets. Parameters are keys by identity and held weakly; a lock guards the table (rank threads
wrap their modules at the same time).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from threadpar.comm.group import ProcessGroup

if TYPE_CHECKING:
    from threadpar.parallel.ddp.reducer import Reducer


@dataclass(frozen=True)
class GradientOwner:
    """The group a parameter's gradient is averaged over, and the reducer that does it (None for a group of
    one rank, where DDP reduces nothing)."""

    group: ProcessGroup
    _reducer: weakref.ReferenceType | None  # weak: the reducer holds the parameter, this table must not

    @property
    def reducer(self) -> Reducer | None:
        return None if self._reducer is None else self._reducer()


_lock = threading.Lock()
_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> list[GradientOwner]


def record(params: Iterable[torch.nn.Parameter], group: ProcessGroup, reducer: Reducer | None) -> None:
    owner = GradientOwner(group, None if reducer is None else weakref.ref(reducer))
    with _lock:
        for param in params:
            _owners.setdefault(param, []).append(owner)


def owners_of(param: torch.nn.Parameter) -> list[GradientOwner]:
    """Every DDP wrapper's record of `param`, oldest first (empty if no DDP wraps it)."""
    with _lock:
        return list(_owners.get(param, ()))
