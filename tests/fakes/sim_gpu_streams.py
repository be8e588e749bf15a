"""`torch.simgpu`'s streams and events: torch.cuda's stream API over the calling rank thread's FakeCuda.

Code written for any accelerator reaches streams through the device's module (`torch.get_device_module(t)`,
FSDP2's `_get_device_handle(device.type)`: `Stream(priority=)`, `current_stream()`, `stream(s)`, `Event()`,
`stream.wait_stream(other)`, `stream.record_event()`). On the double these are the FakeCuda's streams of the
thread's rank (sim_gpu.bound(): run_fake_gpus binds it), so work such code orders with them is what the double's
device runs and checks, and threadpar's collectives issued under `stream(s)` run on `s` (its CudaApi's current
stream is the same FakeCuda's). Each rule as torch/cuda/streams.py and torch/cuda/__init__.py have it:
- `Stream(device, priority)` is one of the device's pool streams (c10/cuda/CUDAStream.cpp, getStreamFromPool);
  two wrappers of one stream are equal and hash alike (torch.cuda.Stream.__eq__/__hash__: the stream's handle);
- `wait_stream(s)` is `wait_event(s.record_event())`; `record_event(None)` records a new event;
- `Event.record(None)` / `Event.wait(None)` use the current stream; `stream(None)` changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import sim_gpu

_idle_lock = threading.Lock()
_idle: list[
    Any
] = []  # the process's GPUs as threads bound to no launch see them (made once, under _idle_lock)


def _fake() -> Any:
    """The FakeCuda whose device the calling thread drives (a rank thread of a double's launch). A thread bound
    to none sees the process's GPUs idle, as torch.cuda's stream API works on any thread of a process that has a
    GPU (torch/cuda/__init__.py, current_stream: the device's default stream): e.g. a host-side rank's
    torch.distributed.checkpoint writer asks the accelerator's current stream (filesystem.py,
    _OverlappingCpuLoader) whichever device its ranks run on."""
    fake = sim_gpu.bound()
    if fake is not None and hasattr(fake, "pool_stream"):
        return fake
    with _idle_lock:
        if not _idle:
            from .fake_cuda_nccl import FakeCuda  # (fake_cuda_nccl imports this module's package first)

            _idle.append(FakeCuda())
        return _idle[0]


def _device(device: Any) -> torch.device:
    if device is None:
        return sim_gpu.device(sim_gpu.current_device())
    if isinstance(device, int):
        return sim_gpu.device(device)
    given = torch.device(device)
    return sim_gpu.device(sim_gpu.current_device() if given.index is None else given.index)


class Stream:
    """torch.cuda.Stream's API over one FakeStream."""

    def __init__(self, device: Any = None, priority: int = 0, *, fake_stream: Any = None) -> None:
        self.fake_stream = (
            fake_stream if fake_stream is not None else _fake().pool_stream(_device(device), priority)
        )

    @property
    def device(self) -> torch.device:
        return sim_gpu.device(self.fake_stream.device_index)

    @property
    def priority(self) -> int:
        return self.fake_stream.priority

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """cudaStreamQuery: has the device run everything enqueued so far? Never blocks."""
        from . import fake_device  # (fake_device imports sim_gpu, which imports this module)

        return fake_device.query(self.fake_stream, len(self.fake_stream.ops) - 1)

    def synchronize(self) -> None:
        self.fake_stream.synchronize()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.fake_stream is self.fake_stream

    def __hash__(self) -> int:
        return hash(id(self.fake_stream))

    def __repr__(self) -> str:
        return f"<torch.{sim_gpu.DEVICE_TYPE}.Stream {self.fake_stream!r}>"


class Event:
    """torch.cuda.Event's API over one FakeEvent (timing and IPC are not modelled)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        if enable_timing or interprocess:
            raise NotImplementedError(f"torch.{sim_gpu.DEVICE_TYPE}.Event: no timing or IPC on the double")
        self.fake_event = _fake().event()

    def record(self, stream: Stream | None = None) -> None:
        self.fake_event.record((stream if stream is not None else current_stream()).fake_stream)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).fake_stream.wait_event(self.fake_event)

    def query(self) -> bool:
        return self.fake_event.query()

    def synchronize(self) -> None:
        self.fake_event.synchronize()


def current_stream(device: Any = None) -> Stream:
    return Stream(fake_stream=_fake().current_stream(_device(device)))


@contextlib.contextmanager
def stream(selected: Stream | None) -> Iterator[None]:
    """torch.cuda.stream: `selected` is its device's current stream while open (None: a no-op)."""
    if selected is None:
        yield
        return
    with _fake().on_streams(selected.fake_stream):
        yield


def synchronize(device: Any = None) -> None:
    _fake().synchronize(_device(device))
