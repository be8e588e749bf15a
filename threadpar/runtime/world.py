"""`World`: everything one launch shares between its rank threads, created by `launch` and dropped after.

Nothing here is module-global: two launches (one after another, or nested) each have their own World,
groups, mailboxes and stop signal. In a multi-process job each process has a World for the whole layout
(every global rank), runs the threads of its own ranks, and reaches the others through `processes`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import CudaApi, NcclRuntime
from threadpar.comm.handle import GroupState
from threadpar.comm.registry import GroupRegistry
from threadpar.comm.select import select_backend
from threadpar.errors import ConfigError
from threadpar.runtime.capture_turns import CaptureTurns
from threadpar.topology import Axes, Layout


class World:
    def __init__(
        self,
        *,
        layout: Layout,
        backend: str,
        devices: tuple[torch.device, ...],
        timeout: float,
        seed: int,
        intraop_threads: int,
        cuda: CudaApi | None = None,
        processes: Any = None,
        check_collectives: bool = False,
        torch_distributed: bool = True,
        rank_cpus: frozenset[int] | None = None,
    ) -> None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if len(devices) != layout.world_size:
            raise ConfigError(f"{len(devices)} devices for a layout of {layout.world_size} ranks")
        self.layout = layout
        self.world_size = layout.world_size
        self.backend = backend
        self.devices = devices
        self.timeout = float(timeout)
        self.seed = seed
        self.intraop_threads = intraop_threads
        # The cores this process's rank threads (and their comm workers) run on; None: not pinned
        # (threadpar.runtime.rank_cores, LaunchConfig.rank_cores).
        self.rank_cpus = rank_cpus
        # The CUDA primitives the backends call (threadpar.comm.nccl.cuda_api); None: torch.cuda. Tests pass a
        # double that is also the NCCL runtime, whose devices then stand in for GPUs.
        self.cuda = cuda
        self.processes = (
            processes  # threadpar.runtime.peer_processes.Processes, or None in a one-process launch
        )
        self.process_rank = 0 if processes is None else processes.rank
        self.threads_per_process = layout.world_size if processes is None else processes.threads_per_process
        # Check every NCCL collective between processes, not only each group's first (LaunchConfig).
        self.check_collectives = check_collectives
        self.abort = AbortSignal()
        # torch.distributed in every rank thread (threadpar.torch_dist; LaunchConfig.torch_distributed).
        self.torch_distributed = torch_distributed
        # Implements threadpar.comm.backend.BackendSite: the backends take what they need from this World.
        self.groups = GroupRegistry(self.world_size, functools.partial(select_backend, self))
        # Where a failure another thread finds for a rank goes (the nccl watchdog): the launch's record, set
        # by _Launch; until then (a World used without a launch) the stop signal alone.
        self.failure_sink: Callable[[int, BaseException], None] | None = None
        self._lock = threading.Lock()  # guards _capture_turns, _closers and _graphs
        self._capture_turns: CaptureTurns | None = None
        self._closers: list[Callable[[bool], None]] = []
        self._graphs: list[Callable[[bool], None]] = []  # each captured graph's release (a graphed step's)

    @property
    def local_ranks(self) -> range:
        """The global ranks whose threads run in this process."""
        start = self.process_rank * self.threads_per_process
        return range(start, start + self.threads_per_process)

    def fail(self, rank: int, error: BaseException) -> None:
        """BackendSite.fail: `error` is global rank `rank`'s failure, found by another thread."""
        sink = self.failure_sink
        if sink is not None:
            sink(rank, error)
        else:
            self.abort.trigger(f"rank {rank} failed with {type(error).__name__}: {error}")

    def capture_turns(self) -> CaptureTurns:
        """The CUDA graph captures of this process's ranks, one at a time (capture_turns.py)."""
        with self._lock:
            if self._capture_turns is None:
                self._capture_turns = CaptureTurns(self.local_ranks, self.abort, self.timeout)
            return self._capture_turns

    def on_close(self, fn: Callable[[bool], None]) -> None:
        """Run `fn(failed)` when the launch ends, before its groups close."""
        with self._lock:
            self._closers.append(fn)

    def keep_graph(self, release: Callable[[bool], None]) -> None:
        """A rank captured a CUDA graph: `release(wait)` resets it (release_graphs)."""
        with self._lock:
            self._graphs.append(release)

    def release_graphs(self, wait: bool) -> None:
        """BackendSite.release_graphs: every graph the launch captured is reset, once, before any communicator
        it may have captured is freed (the launch's end; the watchdog's abort on a failure, which may come first)."""
        with self._lock:
            releases, self._graphs = self._graphs, []
        for release in releases:
            release(wait)

    def close(self, failed: bool) -> None:
        """The launch has ended: every group lets go of what it holds (the nccl backend destroys, pools or,
        `failed`, aborts its communicators); then the process's NCCL watchdog ends if nothing is watched."""
        with self._lock:
            closers, self._closers = self._closers, []
        for closer in closers:
            closer(failed)
        self.release_graphs(wait=not failed)
        errors = []
        for backend in self.groups.backends():
            try:
                backend.close(failed)
            except Exception as error:  # close the others all the same
                errors.append(error)
        if self.backend == "nccl":
            self.nccl_runtime().watchdog.join_if_idle()
        if errors:
            raise errors[0]

    def cuda_api(self) -> CudaApi:
        if self.cuda is not None:
            return self.cuda
        from threadpar.comm.nccl.cuda_api import torch_cuda

        return torch_cuda()

    def nccl_runtime(self) -> NcclRuntime:
        """The NCCL runtime over `cuda`: the double itself when it is one, else the process's real one."""
        if isinstance(self.cuda, NcclRuntime):
            return self.cuda
        if self.cuda is not None:
            raise ConfigError(
                f"World(cuda=...) got a {type(self.cuda).__name__}, which has CUDA primitives but no NCCL runtime "
                "(threadpar.comm.common.cuda_seam.NcclRuntime); the nccl backend needs both: pass a double of both"
            )
        from threadpar.comm.nccl.cuda_api import nccl_runtime

        return nccl_runtime()

    def world_group(self) -> GroupState:
        return self.groups.get_or_create(range(self.world_size), "WORLD")

    def axes_group(self, axes: Axes, rank: int) -> GroupState:
        """`rank`'s group on axes (an axis, axes together, EP or EDP), named as the layout names it."""
        return self.groups.get_or_create(
            self.layout.group_ranks(axes, rank), self.layout.group_name(axes, rank)
        )
