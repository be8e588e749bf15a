"""Which fake GPU a thread is on: the double's CUDA current device.

Each rank thread of a process drives a GPU of its own: threadpar's RankContext.enter makes its device current
(`torch.get_device_module(device).set_device(device)`; on the double the device is `simgpu:i`, sim_gpu.py), and
the current device is per thread, as CUDA's is (c10/cuda/CUDAFunctions.cpp: cudaSetDevice is per host thread).
So the calling thread's fake GPU is its current simgpu device (`fake_device_index`), 0 for a thread that never
set one, as for CUDA; streams and events know their device from it (fake_cuda_nccl.py: FakeStream.device_index,
FakeEvent.record). Ranks that share a GPU (a launch placing more ranks than GPUs round-robin,
threadpar/runtime/devices.py) have the same device, so they share its stream pools and may wait on each other's
events, which torch allows on one device (c10/cuda/CUDAEvent.h: CUDAEvent::record checks the recording stream's
device only). The autograd mode's device threads are bound to their caller's device (`bound_to`), as the
engine's device thread of GPU i runs with device i current (torch/csrc/autograd/engine.cpp: Engine::thread_init
sets the worker's device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from . import sim_gpu

_local = threading.local()


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
    """The calling thread's fake GPU: its current simgpu device (0 unless set)."""
    return sim_gpu.current_device()


@contextlib.contextmanager
def bound_to(index: int, streams: dict | None = None) -> Iterator[None]:
    """Make `index` the calling thread's fake GPU while open, and `streams` (all_current_streams() of
    another thread) its current streams."""
    saved, saved_streams = sim_gpu.current_device(), getattr(_local, "streams", None)
    sim_gpu.set_device(index)
    _local.streams = streams
    try:
        yield
    finally:
        sim_gpu.set_device(saved)
        _local.streams = saved_streams
