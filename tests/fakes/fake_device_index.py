"""Which fake GPU a thread is on: the double's stand-in for CUDA's current device.

With the double every tensor is on the CPU, yet each rank thread of a process drives a GPU of its own
(threadpar's RankContext.enter calls torch.cuda.set_device(world.devices[rank]) on real GPUs). The double
names that GPU by the thread's rank within its process (RankContext.thread_rank), so streams and events know
their device (fake_cuda_nccl.py: FakeStream.device_index, FakeEvent.record). A thread outside any rank is on
device 0, CUDA's default current device. In the shared mode (`sharing_gpus`, issue 29) a launch's ranks share
`gpus` fake GPUs: rank thread r is on fake GPU r % gpus, as launch places more ranks than GPUs round-robin
(threadpar/runtime/devices.py), so ranks on one GPU share its stream pools and may wait on each other's events,
which torch allows on one device (c10/cuda/CUDAEvent.h: CUDAEvent::record checks the recording stream's device
only). The autograd mode's device threads are bound to their caller's
device (`bound_to`), as the engine's device thread of GPU i runs with device i current
(torch/csrc/autograd/engine.cpp: Engine::thread_init sets the worker's device).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from threadpar.runtime import context
from threadpar.runtime.world import World

_local = threading.local()
# The shared mode's launches: World -> how many fake GPUs its ranks share (weak: a finished launch drops out).
# Written by the launching thread, read by every rank thread: guarded by _gpus_lock (DESIGN.md rule 10).
_gpus_of: weakref.WeakKeyDictionary[World, int] = weakref.WeakKeyDictionary()
_gpus_lock = threading.Lock()


def current_streams(fake: object) -> dict:
    """The calling thread's current streams of `fake` (device -> stream): its own, or those it is bound to."""
    bound = getattr(_local, "streams", None)
    if bound is not None and id(fake) in bound:
        return bound[id(fake)]
    own = getattr(_local, "own_streams", None)
    if own is None:
        own = _local.own_streams = {}
    return own.setdefault(id(fake), {})


def all_current_streams() -> dict:
    """Every FakeCuda's current streams of the calling thread (to bind a device thread to them)."""
    merged = dict(getattr(_local, "own_streams", {}))
    merged.update(getattr(_local, "streams", None) or {})
    return merged


def fake_device_index() -> int:
    """The calling thread's fake GPU: a binding (`bound_to`), else its rank within its process (modulo the
    shared mode's GPUs), else 0."""
    bound = getattr(_local, "index", None)
    if bound is not None:
        return bound
    if not context.in_rank():
        return 0
    ctx = context.current()
    with _gpus_lock:
        gpus = _gpus_of.get(ctx.world)
    return ctx.thread_rank if gpus is None else ctx.thread_rank % gpus


@contextlib.contextmanager
def sharing_gpus(world: World, gpus: int) -> Iterator[None]:
    """While open, `world`'s rank threads share `gpus` fake GPUs (rank thread r on r % gpus)."""
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: the ranks need at least one fake GPU to share")
    with _gpus_lock:
        _gpus_of[world] = gpus
    try:
        yield
    finally:
        with _gpus_lock:
            _gpus_of.pop(world, None)


@contextlib.contextmanager
def bound_to(index: int, streams: dict | None = None) -> Iterator[None]:
    """Make `index` the calling thread's fake GPU while open, and `streams` (all_current_streams() of
    another thread) its current streams."""
    saved, saved_streams = getattr(_local, "index", None), getattr(_local, "streams", None)
    _local.index = index
    _local.streams = streams
    try:
        yield
    finally:
        _local.index, _local.streams = saved, saved_streams
