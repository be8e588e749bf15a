"""What the nccl backend keeps per process, because what it guards is process-wide: one launch lock per
device (DeviceLocks), the comm streams live groups hold (CommStreams), and communicator cliques left by
finished launches (CliquePool, CliqueHealth). Plain Python: the real runtime and the test double share these
classes (cuda_api.py makes the process's instances)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

from threadpar.errors import ConfigError

# Streams of higher priority are scheduled first when compute and communication kernels compete;
# torch maps an out-of-range value to the nearest valid priority.
COMM_STREAM_PRIORITY = -1


class DeviceLocks:
    """One lock per CUDA device of this process, held around every NCCL C call on a communicator of that
    device (DESIGN.md rule 7).

    NCCL's thread-safety rules (user guide, usage/threadsafety.html): operations on one communicator must not
    be issued from several threads at once, and issuing in parallel to independent communicators of one device
    from several threads "is not safe"; ncclCommAbort needs no other thread inside an NCCL call on the
    communicator (usage/communicators.html, "Fault Tolerance"). NCCL 2.26+ catches some of these races
    ("host threads racing to launch NCCL on same device", src/misc/strongstream.cc, NCCL_LAUNCH_RACE_FATAL).
    A device's calls come from its rank thread, and sometimes from autograd's device thread (DDP hooks), a
    connector (communicator creation), or the watchdog (async-error queries, aborts): the lock makes them
    take turns. It is held for the C call only (microseconds), never across a wait for peers, except by a
    connector inside a blocking NCCL call that waits for them (creation, first connection), which the
    members only start once every one of them is there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[Any, threading.Lock] = {}

    def lock(self, device: Any) -> threading.Lock:
        """The lock of `device` (a CUDA device index; the double's fake GPU index)."""
        lock = self._locks.get(device)  # (a dict read; made once under _lock: rule 10's write-once case)
        if lock is None:
            with self._lock:
                lock = self._locks.setdefault(device, threading.Lock())
        return lock


class CommStreams:
    """The comm streams live groups hold, per device: no two groups ever share one.

    torch.cuda.Stream(device, priority) does not create a stream: it hands out one of 32 pooled streams per
    device and priority level, round-robin (c10/cuda/CUDAStream.cpp, getStreamFromPool, kStreamsPerPool), so
    past 32 groups on a device two groups would silently get the same stream. Their kernels would then run
    one after the other in the order each process launched them; across processes those orders differ and
    two groups on shared streams can wait on each other in a cycle. So a group asks the pool until it gets a
    stream no live group holds: the high-priority pool first, then the normal one (where communication no
    longer preempts compute); past 64 live streams on a device it is refused with a clear error. A group hands
    its streams back when it closes. (Other code drawing from torch's pool may still get one of these
    streams: its work then waits behind ours, which delays it but closes no cycle.)"""

    PRIORITIES = (COMM_STREAM_PRIORITY, 0)
    STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp: kStreamsPerPool

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[tuple[str, Any]] = set()  # torch.cuda.Stream hashes and compares by the CUDA stream
        # Streams handed back from a finalizer (a group dropped without closing), not yet out of _held: the
        # garbage collector may run a finalizer on any thread at any allocation, also on a thread that holds
        # _lock inside acquire (which allocates), so release must not take _lock. SimpleQueue.put is reentrant
        # (made for finalizers); the next holder of _lock drains it.
        self._returned: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def acquire(self, cuda: Any, device: torch.device) -> Any:
        with self._lock:
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
            "no longer needed (a group's streams come back when its launch ends)"
        )

    def release(self, devices: Iterable[torch.device], streams: Iterable[Any]) -> None:
        """Hand a group's streams back (never blocks: see _returned)."""
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
    timed out or saw an asynchronous NCCL error (they may hold half-done work). Set by the group's Works and
    the watchdog; read when the group closes."""

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


class CliquePool:
    """Communicator cliques of one-process groups whose launches ended cleanly, kept for the next launch on
    the same devices (keyed by the members' devices): creating one is a blocking ncclCommInitRank on every
    member (NCCL sets up its topology, buffers and, with NCCL_RUNTIME_CONNECT=0, every algorithm's
    connections), and a test suite launches hundreds of times. A pooled clique keeps all of its NCCL buffers
    (some 0.8 GiB per GPU for an 8-GPU group of an NVSwitch node: tests/fakes/fake_nccl_memory.py), so the
    pool is bounded: at most `per_key` cliques per key and `total` in all, the oldest handed back first; `put`
    returns what it does not keep, for the caller to destroy, and the process's pool is drained at exit
    (cuda_api.py: `release_pooled`) (benchmarks/nccl_comm_cost.py measures what reuse saves)."""

    PER_KEY = 4
    TOTAL = 16

    def __init__(self, per_key: int = PER_KEY, total: int = TOTAL) -> None:
        self._lock = threading.Lock()
        self._per_key = per_key
        self._total = total
        self._free: dict[tuple[str, ...], list[list[Any]]] = {}
        self._order: list[tuple[str, ...]] = []  # the key of every pooled clique, oldest first

    def take(self, devices: tuple[str, ...]) -> list[Any] | None:
        with self._lock:
            free = self._free.get(devices)
            if not free:
                return None
            self._order.reverse()  # (its newest entry: the clique pop() takes)
            self._order.remove(devices)
            self._order.reverse()
            return free.pop()

    def put(self, devices: tuple[str, ...], comms: list[Any]) -> list[Any]:
        """Keep a clique for later; returns the communicators it did not keep (its key's share is full), and
        those of the oldest cliques it let go of for it (the pool is full)."""
        with self._lock:
            free = self._free.setdefault(devices, [])
            if len(free) >= self._per_key:
                return list(comms)
            free.append(list(comms))
            self._order.append(devices)
            dropped: list[Any] = []
            while len(self._order) > self._total:
                oldest = self._order.pop(0)
                dropped += self._free[oldest].pop(0)
            return dropped

    def drain(self) -> list[Any]:
        """Every pooled communicator, the pool left empty (for the caller to destroy)."""
        with self._lock:
            cliques = [c for free in self._free.values() for c in free]
            self._free.clear()
            self._order.clear()
        return [comm for clique in cliques for comm in clique]

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)
