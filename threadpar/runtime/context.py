"""The per-rank context, and the accessors user code calls inside a launched rank thread.

Each rank thread has one RankContext (thread-local). Capture what you need from it (the rank, a group
handle) when you build an autograd Function or hook, rather than reading it there: on CUDA, backward
runs on PyTorch's device threads, where there is no rank context.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from threadpar.comm.common.worker import CommWorker
from threadpar.comm.group import GroupState, ProcessGroup
from threadpar.errors import NotInRankError
from threadpar.runtime.rng import derive_seed, make_generator
from threadpar.runtime.world import World
from threadpar.topology import Axis, Coords, Layout

_local = threading.local()


class RankContext:
    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.coords: Coords = world.layout.coords_of(rank)
        self.device: torch.device = world.devices[rank]
        self.thread_rank = rank - world.process_rank * world.threads_per_process
        self.generator = make_generator(self.device, derive_seed(world.seed, "rank", rank))
        self.worker = CommWorker(f"threadpar-comm-{rank}", on_start=self.enter)
        self._handles: dict[int, ProcessGroup] = {}
        self._world_handle: ProcessGroup | None = None
        # Per-rank objects that higher layers create on first use (e.g. the tensor-parallel RNG tracker),
        # keyed by a name of their choosing: rank state lives here, never in module globals.
        self.extras: dict[str, Any] = {}

    def enter(self) -> None:
        """Make this the calling thread's context (rank thread or its comm worker); set its thread count."""
        _local.ctx = self
        torch.set_num_threads(self.world.intraop_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def handle(self, state: GroupState) -> ProcessGroup:
        handle = self._handles.get(id(state))
        if handle is None:
            handle = self._handles[id(state)] = ProcessGroup(state, self.rank, self.worker, self.world.abort)
        return handle

    def group(self, which: Axis | str | ProcessGroup | None = None) -> ProcessGroup:
        """None: the world; an axis ("TP" or Axis.TP): this rank's group on it; a name ("TP1"): that group."""
        if which is None:
            if self._world_handle is None:
                self._world_handle = self.handle(self.world.world_group())
            return self._world_handle
        if isinstance(which, ProcessGroup):
            return which
        if isinstance(which, Axis) or (isinstance(which, str) and which.upper() in Axis.__members__):
            return self.handle(self.world.axis_group(which, self.rank))
        if isinstance(which, str):
            return self.handle(self.world.groups.get(which))
        raise TypeError(
            f"group must be None, an Axis, an axis or group name, or a ProcessGroup; got {which!r}"
        )


def current() -> RankContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise NotInRankError(
            "this threadpar call needs a rank, but the calling thread was not started by threadpar.launch; "
            "call it inside the function you pass to threadpar.launch(fn, ...)"
        )
    return ctx


def leave() -> None:
    _local.ctx = None


def in_rank() -> bool:
    """True inside a thread started by threadpar.launch."""
    return getattr(_local, "ctx", None) is not None


def get_rank() -> int:
    """This rank's global rank."""
    return current().rank


def get_world_size() -> int:
    return current().world.world_size


def get_device() -> torch.device:
    """The device this rank computes on (cuda:i, or cpu for CPU virtual devices)."""
    return current().device


def get_group(axis: Axis | str | None = None) -> ProcessGroup:
    """This rank's group on `axis` ("DP", "TP", "PP", "CP"), or the world group when None."""
    return current().group(axis)


def get_coords() -> Coords:
    return current().coords


def get_layout() -> Layout:
    return current().world.layout


def get_thread_rank() -> int:
    """This rank's index among the rank threads of its process."""
    return current().thread_rank


def get_process_rank() -> int:
    """The index of this process (0 when all ranks are threads of one process)."""
    return current().world.process_rank


def is_main_rank() -> bool:
    return current().rank == 0


def get_generator() -> torch.Generator:
    """This rank's own generator on its device, seeded from launch(seed=...) and the rank."""
    return current().generator


def get_seed(*keys: int | str) -> int:
    """A seed derived from the launch's base seed and `keys` (equal on every rank for equal keys)."""
    return derive_seed(current().world.seed, *keys)
