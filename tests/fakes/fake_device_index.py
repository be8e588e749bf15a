"""Which fake GPU a thread is on: the double's stand-in for CUDA's current device.

With the double every tensor is on the CPU, yet each rank thread of a process drives a GPU of its own
(threadpar's RankContext.enter calls torch.cuda.set_device(world.devices[rank]) on real GPUs). The double
names that GPU by the thread's rank within its process (RankContext.thread_rank), so streams and events know
their device (fake_cuda_nccl.py: FakeStream.device_index, FakeEvent.record). A thread outside any rank is on
device 0, CUDA's default current device. The autograd mode's device threads are bound to their caller's
device (`bound_to`), as the engine's device thread of GPU i runs with device i current
(torch/csrc/autograd/engine.cpp: Engine::thread_init sets the worker's device).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from threadpar.runtime import context

_local = threading.local()


def fake_device_index() -> int:
    """The calling thread's fake GPU: a binding (`bound_to`), else its rank within its process, else 0."""
    bound = getattr(_local, "index", None)
    if bound is not None:
        return bound
    return context.current().thread_rank if context.in_rank() else 0


@contextlib.contextmanager
def bound_to(index: int) -> Iterator[None]:
    """Make `index` the calling thread's fake GPU while open."""
    saved = getattr(_local, "index", None)
    _local.index = index
    try:
        yield
    finally:
        _local.index = saved
