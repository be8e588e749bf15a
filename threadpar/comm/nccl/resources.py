"""What the nccl backend keeps per process, because what it guards is process-wide: communicator cliques
left by finished launches (CliquePool, CliqueHealth), the comm streams live groups hold (CommStreams), and
the devices whose communicators are being created (DeviceInits). Plain Python: the real CudaApi and the
test double share these classes (cuda_api.py makes the process's instances)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from threadpar.errors import CollectiveTimeoutError, ConfigError

# Streams of higher priority are scheduled first when compute and communication kernels compete;
# torch maps an out-of-range value to the nearest valid priority.
COMM_STREAM_PRIORITY = -1


class CommStreams:
    """The comm streams live groups hold, per device: no two groups ever share one.

    torch.cuda.Stream(device, priority) does not create a stream: it hands out one of 32 pooled streams per
    device and priority level, round-robin (c10/cuda/CUDAStream.cpp, getStreamFromPool, kStreamsPerPool), so
    past 32 groups on a device two groups would silently get the same stream. Their kernels would then run
    one after the other in the order each process launched them; across processes those orders differ and
    two groups on shared streams can wait on each other in a cycle. So a group asks the pool until it gets a
    stream no live group holds: the high-priority pool first, then the normal one (where communication no
    longer preempts compute); past 64 live groups on a device it is refused with a clear error. A group hands
    its streams back when it is dropped. (Other code drawing from torch's pool may still get one of these
    streams: its work then waits behind ours, which delays it but closes no cycle.)"""

    PRIORITIES = (COMM_STREAM_PRIORITY, 0)
    STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp: kStreamsPerPool

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[tuple[str, Any]] = set()  # torch.cuda.Stream hashes and compares by the CUDA stream
        self._lanes: dict[tuple[str, int], Any] = {}
        # Streams handed back by dropped groups, not yet out of _held: release runs in a weakref finalizer,
        # which the garbage collector may run on any thread at any allocation, also on a thread that holds
        # _lock inside _take (which allocates): it must not take _lock. SimpleQueue.put is reentrant (made
        # for finalizers); the next holder of _lock drains it.
        self._returned: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def acquire(self, cuda: Any, device: torch.device) -> Any:
        with self._lock:
            return self._take(cuda, device)

    def lane(self, cuda: Any, device: torch.device, index: int) -> Any:
        """Copy lane `index` of `device`: a stream of its own, kept for the process, shared by every group.
        Copies from one device to different destinations go on different lanes, so that they run at the
        same time (nccl/copies.py); they are fenced with events at both ends of each collective."""
        with self._lock:
            lane = self._lanes.get((str(device), index))
            if lane is None:
                lane = self._lanes[str(device), index] = self._take(cuda, device)
            return lane

    def _take(self, cuda: Any, device: torch.device) -> Any:
        self._drain_returned()
        for priority in self.PRIORITIES:
            for _ in range(self.STREAMS_PER_POOL):
                stream = cuda.pool_stream(device, priority)
                if (str(device), stream) not in self._held:
                    self._held.add((str(device), stream))
                    return stream
        limit = len(self.PRIORITIES) * self.STREAMS_PER_POOL
        raise ConfigError(
            f"{device} already has {limit} communication streams held by live NCCL groups (torch's stream pool "
            f"has {self.STREAMS_PER_POOL} per priority and device): use fewer groups per device, or drop groups "
            "no longer needed (a group's streams come back when it is garbage-collected)"
        )

    def release(self, devices: Iterable[torch.device], streams: Iterable[Any]) -> None:
        """Hand a dropped group's streams back (from its finalizer: never blocks, see _returned)."""
        for device, stream in zip(devices, streams):
            if stream is not None:
                self._returned.put((str(device), stream))

    def _drain_returned(self) -> None:
        """Take the handed-back streams out of _held; the caller holds _lock."""
        while True:
            try:
                self._held.discard(self._returned.get_nowait())
            except queue.Empty:
                return


class CliqueHealth:
    """Whether a group's communicators may serve another launch: not once any of its operations failed,
    timed out or saw an asynchronous NCCL error (they may hold half-done work, and torch can neither
    abort nor destroy them). Set by the group's Works; read when the group hands its clique back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spoiled: str | None = None

    def spoil(self, reason: str) -> None:
        with self._lock:
            if self._spoiled is None:
                self._spoiled = reason

    @property
    def spoiled(self) -> str | None:
        with self._lock:
            return self._spoiled


class DeviceInits:
    """Which devices of this process are inside ncclCommInitRank right now.

    NCCL forbids issuing operations on other communicators of a device from other threads while one is
    being created there (NCCL docs, "Thread Safety"; communicator creation counts as an operation). A member
    marks its device under the launch lock (so no launch is issuing at that moment) and unmarks it when its
    init returns; a launch that finds one of its devices marked lets go of the lock and waits. Nobody waits
    while holding the launch lock: an init across processes may wait for other processes' members, which
    must not be kept from marking their own devices (that could form a cycle through two launch locks)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count: dict[torch.device, int] = {}  # only devices inside an init (no zero counts)

    def enter(self, device: torch.device) -> None:
        with self._cond:
            self._count[device] = self._count.get(device, 0) + 1

    def leave(self, device: torch.device) -> None:
        with self._cond:
            self._count[device] -= 1
            if not self._count[device]:
                del self._count[device]
            self._cond.notify_all()

    def busy(self, devices: Iterable[torch.device]) -> bool:
        """Asked by every launch: a dict that is empty unless an init is under way."""
        with self._cond:
            return bool(self._count) and any(d in self._count for d in devices)

    def wait_idle(self, devices: Iterable[torch.device], abort: Any, timeout: float) -> None:
        """Until none of `devices` is in an init (bounded; a stop of the launch ends it)."""
        devices = list(devices)
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(d in self._count for d in devices):
                abort.raise_if_set()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeoutError(
                        f"waited {timeout:g} s for NCCL communicators being created on {[str(d) for d in devices]}"
                    )
                self._cond.wait(min(remaining, 0.05))


class CliquePool:
    """NCCL communicators (one clique per group) left by finished launches, keyed by the members' devices.
    Only cliques of groups that never saw trouble, in launches that were not stopped, come back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[str, ...], list[list[Any]]] = {}

    def take(self, devices: tuple[str, ...]) -> list[Any] | None:
        with self._lock:
            free = self._free.get(devices)
            return free.pop() if free else None

    def give_back(
        self,
        devices: tuple[str, ...],
        comms: list[Any],
        health: CliqueHealth | None = None,
        abort: Any = None,
    ) -> None:
        if any(c is None for c in comms):
            return  # a member never made its communicator: not a usable clique
        if (health is not None and health.spoiled) or (abort is not None and abort.is_set):
            return  # failed, timed out, async error, or its launch was stopped: never reused (leaked)
        with self._lock:
            self._free.setdefault(devices, []).append(list(comms))
