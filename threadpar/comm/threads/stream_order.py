"""Stream ordering for the `threads` backend on CUDA tensors (several ranks sharing a GPU).

On the threads backend a collective's work is done by rank threads reading and writing each other's
tensors. On CUDA a rank's tensor is produced by kernels on *that rank's* current stream, while the thread
that reads it enqueues its kernels on *its own* current stream, and the meeting ends when the host has
enqueued the work, not when the device has done it. So, per collective:

1. each member records a ready event on its current stream as it arrives;
2. a thread that works on the members' tensors makes its current streams wait for every ready event
   first, and records a done event on each of them when it has enqueued its share;
3. before leaving the collective, each member makes its current stream wait for every done event, so its
   next kernels neither read unfinished results nor overwrite tensors a peer still reads.

When all ranks use one device's default stream these waits are free no-ops in effect; they matter when a
rank computes on its own stream (torch.cuda.stream(...)) or ranks span GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from threadpar.comm.common.cuda_seam import CudaApi


class Fences:
    """The events of one collective: each member's ready event, and the done events of each worker."""

    __slots__ = ("done", "ready")

    def __init__(self, ready: list[Any]) -> None:
        self.ready = ready
        self.done: list[list[Any]] = []


class StreamOrder:
    def __init__(self, cuda: CudaApi, devices: Sequence[torch.device]) -> None:
        self._cuda = cuda
        self.devices = tuple(devices)
        self._distinct = tuple(dict.fromkeys(self.devices))  # the devices a worker may touch, in order

    def arrive(self, member: int) -> Any:
        """Step 1, on the member's thread: its ready event."""
        event = self._cuda.event()
        event.record(self._cuda.current_stream(self.devices[member]))
        return event

    def begin(self, fences: Fences) -> None:
        """Step 2, before a thread touches the members' tensors."""
        for device in self._distinct:
            stream = self._cuda.current_stream(device)
            for event in fences.ready:
                stream.wait_event(event)

    def end(self, fences: Fences) -> None:
        """Step 2, after that thread has enqueued its share (publish before the final meeting)."""
        done = []
        for device in self._distinct:
            event = self._cuda.event()
            event.record(self._cuda.current_stream(device))
            done.append(event)
        fences.done.append(done)

    def leave(self, fences: Fences, member: int) -> None:
        """Step 3, on the member's thread, after the final meeting."""
        stream = self._cuda.current_stream(self.devices[member])
        for done in fences.done:
            for event in done:
                stream.wait_event(event)

    def received(self, member: int, sent: Any, message: torch.Tensor) -> None:
        """A point-to-point message: the receiver's stream waits for the sender's copy (its `arrive` event),
        and the buffer, allocated on the sender's stream, is kept until the receiver's stream is done with it."""
        stream = self._cuda.current_stream(self.devices[member])
        stream.wait_event(sent)
        self._cuda.record_stream(message, stream)
