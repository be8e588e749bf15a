"""The per-rank context, and the accessors user code calls inside a launched rank thread.

Each rank thread has one RankContext (thread-local). Capture what you need from it (the rank, a group
handle) when you build an autograd Function or hook, rather than reading it there: on CUDA, backward
runs on PyTorch's device threads, where there is no rank context.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from threadpar.comm import rank_groups
from threadpar.comm.common.gpu import is_gpu, set_current_device
from threadpar.comm.common.worker import CommWorker
from threadpar.errors import NotInRankError
from threadpar.runtime.intraop import set_thread_intraop_threads
from threadpar.runtime.param_table import ParamTable
from threadpar.runtime.rank_cores import pin_calling_thread
from threadpar.runtime.rng import derive_seed, make_generator
from threadpar.runtime.rng_tracker import RNGTracker
from threadpar.runtime.world import World
from threadpar.topology import Coords, Layout

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
        # This rank's group handles; the collectives find them through the thread-local that enter() binds.
        self.groups = rank_groups.RankGroups(world, rank, self.worker)
        # The tensor-parallel RNG streams (dropout masks, initial weights); generators made on first use.
        self.rng_tracker = RNGTracker(world.seed, self.coords, self.device)
        # What the wrappers record about the parameters they hold (threadpar.parallel.records.ParamRecord):
        # DDP's group, reducer and each gradient's placement, read by ZeRO and clipping.
        self.params: ParamTable[Any] = ParamTable()

    def enter(self) -> None:
        """Make this the calling thread's context (rank thread or its comm worker); set its cores and thread count."""
        _local.ctx = self
        rank_groups.bind(self.groups)
        pin_calling_thread(self.world.rank_cpus)
        set_thread_intraop_threads(self.world.intraop_threads)
        if is_gpu(self.device):
            set_current_device(self.device)


def current() -> RankContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise NotInRankError(rank_groups.NOT_IN_RANK)
    return ctx


def leave() -> None:
    _local.ctx = None
    rank_groups.bind(None)


def in_rank() -> bool:
    """True inside a thread started by threadpar.launch."""
    return getattr(_local, "ctx", None) is not None


def get_device() -> torch.device:
    """The device this rank computes on (cuda:i, or cpu for CPU virtual devices)."""
    return current().device


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
