"""The double's lazy comm streams and its weak logs (used by fake_cuda_nccl.py and fake_nccl.py).

Lazy mode: an NCCL collective the double is given does not run at launch. It waits on its comm streams and runs
only when something waits for it: a stream waiting on an event recorded after it (cudaStreamWaitEvent), the
host querying or synchronizing such an event or stream (cudaEventQuery/Synchronize, cudaStreamSynchronize,
cudaDeviceSynchronize), or host-issued work entering that stream (the double runs torch ops at once, so work
enqueued behind the collective must find it done). That is a legal CUDA schedule: CUDA promises only stream
order and event edges (CUDA C Programming Guide, "Streams" and "Events"; runtime API docs of
cudaStreamWaitEvent), never that a launched kernel has started, so a slow comm stream may start it as late as
the first thing that waits for it. A buffer of the collective that changes between its launch and its run
(someone wrote an input or an output before waiting on the Work) is a race: on a GPU the kernel would read or
clobber the new bytes, depending on timing. The double reports it (`FakeCuda.races`) and raises.

Weak logs: what the double logs about tensors (`TensorRecord`) holds them through weak references, so the logs
never keep a buffer alive that threadpar let go of (torch's record_stream only marks the allocator's block:
c10/cuda/CUDACachingAllocator.cpp, recordStream, keeps no reference to the tensor).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Pending collectives span the streams (and simulated processes) of several FakeCudas: one lock runs them.
RUN_LOCK = threading.RLock()
_PENDING: dict[int, PendingOp] = {}  # id -> every collective launched lazily that has not run yet


class TensorRecord:
    """What the double remembers about a tensor it saw: its address and type, and a weak reference."""

    __slots__ = ("_ptr", "_ref", "dtype", "numel", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ptr = tensor.data_ptr()
        self.dtype, self.shape, self.numel = tensor.dtype, tuple(tensor.shape), tensor.numel()
        self._ref = weakref.ref(tensor)

    def data_ptr(self) -> int:
        return self._ptr

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor, while something else keeps it alive."""
        live = self._ref()
        if live is None:
            raise LookupError(
                "the double logged this tensor, which is gone now (its log holds weak references)"
            )
        return live

    def refers_to(self, tensor: torch.Tensor) -> bool:
        return self._ref() is tensor


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass(eq=False)
class PendingOp:
    """A launched collective that has not run yet: `run()` computes it (returns NCCL's error, if any)."""

    name: str
    run: Callable[[], str | None]
    reads: list[torch.Tensor]  # strong references, as the device holds the buffers until it runs
    writes: list[torch.Tensor]
    places: list[tuple[Any, int]] = field(default_factory=list)  # (stream, node index) of each part
    snapshots: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def snapshot(self) -> None:
        self.snapshots = [t.clone() for t in (*self.reads, *self.writes)]

    def changed(self) -> list[str]:
        out = []
        for k, (now, then) in enumerate(zip((*self.reads, *self.writes), self.snapshots)):
            if not torch.equal(now.reshape(-1).view(torch.uint8), then.reshape(-1).view(torch.uint8)):
                what = "input" if k < len(self.reads) else "output"
                out.append(f"{what} {k if k < len(self.reads) else k - len(self.reads)}")
        return out


def attach(op: PendingOp, parts: list[tuple[Any, int]]) -> None:
    """Put `op` on its comm streams (each part's stream, at the node where the launch logged it)."""
    with RUN_LOCK:
        op.places = parts
        op.snapshot()
        _PENDING[id(op)] = op
        for stream, index in parts:
            stream.pending[index] = op


def flush(stream: Any, upto: int | None = None) -> None:
    """Run what `stream` holds up to node `upto` (all of it: None), following the events it waits on."""
    with RUN_LOCK:
        last = len(stream.ops) - 1 if upto is None else upto
        index = stream.flushed + 1
        while index <= last:
            op = stream.ops[index]
            if op[0] == "wait" and op[2] is not None:
                flush(op[2].stream, op[2].index)
            pending = stream.pending.get(index)
            if pending is not None and not pending.done:
                _run(pending)
            stream.flushed = index
            index += 1


def _run(op: PendingOp) -> None:
    for stream, index in op.places:  # what precedes it on each of its streams runs first
        flush(stream, index - 1)
    if op.done:
        return
    changed = op.changed()
    op.done = True
    _PENDING.pop(id(op), None)
    for stream, index in op.places:
        stream.pending.pop(index, None)
    fake = op.places[0][0].fake
    if changed:
        message = (
            f"race: {op.name}'s {', '.join(changed)} changed between its launch and its run on the comm stream "
            "(a GPU would read or overwrite the new bytes depending on timing): wait on its Work before "
            "touching its buffers"
        )
        fake.report_race(message)
        raise RuntimeError(message)
    error = op.run()
    written = op.writes
    for other in list(_PENDING.values()):  # what it wrote is the later collectives' legitimate starting point
        if any(_same_memory(w, t) for w in written for t in (*other.reads, *other.writes)):
            other.snapshot()
    op.reads, op.writes, op.snapshots = [], [], []  # ran: the device no longer holds the buffers
    if error is not None:
        fake.async_error_message = error
