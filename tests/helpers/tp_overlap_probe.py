"""Probes for the TP overlap tests: what a layer's backward does, and in which order.

`CollectiveLog` wraps the collectives of one ProcessGroup handle (the one the layers captured) and records
"start <op>" when a collective is issued asynchronously, "wait <op>" when its Work is waited on, and
"sync <op>" for a blocking one. `GemmLog` is a TorchDispatchMode that records "dgrad" and "wgrad" when
an aten matmul produces the input gradient or the weight gradient (told apart by their shapes; the test
picks sizes where they differ), and can run a callback at that point (to mark a fake CUDA stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from fakes.sim_gpu_engine import dispatch_boundary
from torch.utils._python_dispatch import TorchDispatchMode

WRAPPED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
SHORT = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _LoggedWork:
    """Forwards to a Work; records when it is waited on."""

    def __init__(self, work, log: CollectiveLog, name: str) -> None:
        self._work, self._log, self._name = work, log, name

    def wait(self, *args, **kwargs):
        self._log.add(f"wait {self._name}")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveLog:
    def __init__(self, group, events: list[str], lock: threading.Lock) -> None:
        self.events, self.lock = events, lock
        self.recording = False
        for op in WRAPPED:
            setattr(group, op, self._wrap(SHORT[op], getattr(group, op)))

    def add(self, event: str) -> None:
        if self.recording:
            with self.lock:
                self.events.append(event)

    def _wrap(self, name: str, method):
        def logged(*args, async_op: bool = False, **kwargs):
            self.add(f"{'start' if async_op else 'sync'} {name}")
            work = method(*args, async_op=async_op, **kwargs)
            return _LoggedWork(work, self, name) if async_op else work

        return logged


class GemmLog(TorchDispatchMode):
    """Records "dgrad" / "wgrad" for matmuls whose result is [tokens, in] / the weight's shape (or its
    transpose: F.linear's backward computes W^T's gradient); `around(kind, "before" | "after")` runs
    just before and after that GEMM."""

    def __init__(
        self,
        log: CollectiveLog,
        tokens: int,
        weight_shape,
        around: Callable[[str, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.log, self.around = log, around
        out, inp = weight_shape
        self.kinds = {(tokens, inp): "dgrad", (out, inp): "wgrad", (inp, out): "wgrad"}

    @dispatch_boundary  # (it runs inside backward: on the CUDA double, an error must reach backward's caller)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = None
        if func in MATMULS:
            rows, cols = args[-2].shape[-2], args[-1].shape[-1]
            kind = self.kinds.get((rows, cols))
        if kind is None:
            return func(*args, **(kwargs or {}))
        if self.around is not None:
            self.around(kind, "before")
        self.log.add(kind)
        result = func(*args, **(kwargs or {}))
        if self.around is not None:
            self.around(kind, "after")
        return result
