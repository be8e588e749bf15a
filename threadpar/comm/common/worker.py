"""The per-rank communication worker: the CPU analogue of a communication stream.

Asynchronous operations of one rank run here one after another, in the order they were issued, so they
overlap the rank's computation. The thread starts on the first asynchronous operation.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from threadpar.comm.common.work import ON_COMM_WORKER, Work
from threadpar.errors import ThreadparError


class CommWorker:
    def __init__(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        self._name = name
        self._on_start = on_start
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Work] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: Work | None = None  # only the owning rank submits, so FIFO order makes this enough

    def wait_idle(self) -> None:
        """Wait until everything submitted so far has finished (their errors stay with their Works)."""
        if self._last is not None:
            self._last.wait_done()

    def submit(self, fn: Callable[[], Any], work: Work) -> Work:
        if self._thread is not None and threading.current_thread() is self._thread:
            # A callback run on completion (add_done_callback) issued an async op: it would queue behind
            # the op whose completion runs it, and its wait would never end.
            raise ThreadparError(
                f"{work!r} was issued from a callback that {self._name} runs as an earlier op completes "
                "(Future.add_done_callback); such a callback must not issue asynchronous operations. Use "
                "Future.then, which threadpar runs on the rank's own thread after waiting for the op, or "
                "wait() the op and issue the next one from the rank's code"
            )
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._last = work
        self._queue.put((fn, work))
        return work

    def _loop(self) -> None:
        # Collectives write their outputs outside autograd, as torch's ProcessGroup ops do (c10d ops are
        # not differentiable). Grad mode is per thread: with it on here, writing an input that requires grad
        # into views the rank made under no_grad (in backward) would raise.
        torch.set_grad_enabled(False)
        ON_COMM_WORKER.active = True
        if self._on_start is not None:
            self._on_start()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work = item
            del item
            # The op's closure holds its tensors: drop it BEFORE finishing the Work, so that a waiter woken by
            # the finish never sees this thread still holding a payload (and before blocking for the next op).
            try:
                result = fn()
            except BaseException as error:
                del fn
                work._finish(error=error)
            else:
                del fn
                work._finish(result)
                del result
            del work

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
