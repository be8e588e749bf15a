"""Each rank thread's own groups, found through a thread-local (what torch.distributed's c10d keeps per process).

The runtime (threadpar.runtime.context) binds a RankGroups to every rank thread and its comm worker; the
module-level collectives (functional.py) find the calling rank's group here. The dependency points one way:
the runtime builds on comm, and comm never imports the runtime.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.worker import CommWorker
from threadpar.comm.group import GroupState, ProcessGroup
from threadpar.comm.registry import GroupRegistry
from threadpar.errors import NotInRankError
from threadpar.topology import Axes, Axis, names_axes

_local = threading.local()

NOT_IN_RANK = (
    "this threadpar call needs a rank, but the calling thread was not started by threadpar.launch; "
    "call it inside the function you pass to threadpar.launch(fn, ...)"
)


class GroupSource(Protocol):
    """What a rank's groups come from: the launch's World (threadpar.runtime.world.World)."""

    world_size: int
    groups: GroupRegistry
    abort: AbortSignal
    backend: str  # "threads" or "nccl"
    devices: tuple[torch.device, ...]  # one per global rank
    timeout: float  # seconds: the launch's, and every group's unless new_group(timeout=...) gives its own

    def world_group(self) -> GroupState: ...

    def axes_group(self, axes: Axes, rank: int) -> GroupState: ...


class RankGroups:
    """One rank's handles on the groups of its launch, one ProcessGroup per group (created on first use)."""

    def __init__(self, source: GroupSource, rank: int, worker: CommWorker | None) -> None:
        self.source = source
        self.rank = rank
        self._worker = worker
        self._handles: dict[int, ProcessGroup] = {}
        self._world_handle: ProcessGroup | None = None

    def handle(self, state: GroupState) -> ProcessGroup:
        handle = self._handles.get(id(state))
        if handle is None:
            handle = self._handles[id(state)] = ProcessGroup(
                state, self.rank, self._worker, self.source.abort
            )
        return handle

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.source.devices[self.rank]

    def group(self, which: Axes | ProcessGroup | None = None) -> ProcessGroup:
        """None: the world; axes (an axis "TP" or Axis.TP, axes together ("DP", "CP"), an expert axis "EP"
        or "EDP"): this rank's group on it; a name ("TP1", "DPCP0"): that group."""
        if which is None:
            if self._world_handle is None:
                self._world_handle = self.handle(self.source.world_group())
            return self._world_handle
        if isinstance(which, ProcessGroup):
            return which
        if isinstance(which, Axis) or names_axes(which):
            return self.handle(self.source.axes_group(which, self.rank))
        if isinstance(which, str):
            return self.handle(self.source.groups.get(which))
        raise TypeError(
            f"group must be None, axes (an axis, a tuple of axes, EP or EDP), a group name, or a "
            f"ProcessGroup; got {which!r}"
        )


def bind(groups: RankGroups | None) -> None:
    """Make `groups` the calling thread's (None: the thread leaves its rank)."""
    _local.groups = groups


def has_groups() -> bool:
    """Whether the calling thread is a rank's (or its comm worker)."""
    return getattr(_local, "groups", None) is not None


def current_groups() -> RankGroups:
    groups = getattr(_local, "groups", None)
    if groups is None:
        raise NotInRankError(NOT_IN_RANK)
    return groups
