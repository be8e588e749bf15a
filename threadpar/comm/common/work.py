"""`Work`: the handle of an asynchronous operation, as torch.distributed returns for `async_op=True`."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from threadpar.comm.common.abort import POLL_INTERVAL_S, AbortSignal
from threadpar.errors import CollectiveTimeoutError

# Guards the hand-over between `get_future()` and `_finish()`, which may run on different threads.
_FUTURE_LOCK = threading.Lock()

# Set on a rank's communication worker (worker.py): there, waiting for a pending op would wait on itself.
ON_COMM_WORKER = threading.local()


class OrderedFuture(torch.futures.Future):
    """The future of an asynchronous op: `then(callback)` waits for the op, then runs the callback at once
    on the calling thread, so the collectives a callback issues (PowerSGD's hook: an all-reduce, then in its
    callbacks two more) come in the rank's program order, the same on every rank. Run on completion by the
    communication worker, they came after whichever ops the rank had issued meanwhile (backward goes on),
    an order that differs between ranks, and a callback waiting for its own collective waited on the very
    worker that runs it. Waiting first is what torch's threaded process group does (its ops complete at
    issue) and what a CUDA future does (complete once the stream is ordered). `add_done_callback` still
    runs its callback on the worker when the op completes, overlapping the rank's work (threadpar's own
    DDP hooks): such a callback must not issue collectives (worker.py refuses them)."""

    def __init__(self, wait_done: Callable[[], None]) -> None:
        super().__init__()
        self._wait_done = wait_done  # returns once the op is done (wakes on the launch's stop)

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        if not getattr(ON_COMM_WORKER, "active", False):
            self._wait_done()
            # The op is done; its worker completes this future right after (Work._finish): wait for that
            # too, or the callback would still run on the worker. The op's error stays in the future.
            with contextlib.suppress(Exception):
                super().wait()
        return super().then(callback)


class LazyText:
    """A message formatted only if it is shown (an error, a repr): a Work's description is made for every
    asynchronous operation and almost never read."""

    __slots__ = ("_args", "_template")

    def __init__(self, template: str, *args: object) -> None:
        self._template, self._args = template, args

    def __str__(self) -> str:
        return self._template.format(*self._args)


class Work:
    """Completes when its operation has finished on this rank; `wait()` re-raises the operation's error."""

    __slots__ = ("_abort", "_description", "_done", "_error", "_future", "_result")

    def __init__(self, description: str | LazyText, abort: AbortSignal | None = None) -> None:
        self._description: object = description  # shown with str(); lazy on the hot paths
        self._abort = abort
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None
        self._future: torch.futures.Future | None = None

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with _FUTURE_LOCK:
            self._done.set()
            future = self._future
        if future is not None:
            self._complete(future)

    def _complete(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

    def get_future(self) -> torch.futures.Future:
        """A torch.futures.Future that completes with the operation (as torch's Work.get_future()): its
        value is the result (for an all-reduce, the list of its tensors), or it holds the error. `then`
        waits for the operation and runs its callback on the calling thread (OrderedFuture);
        `add_done_callback` runs on the thread that completes the operation (the rank's communication
        worker for async ops), overlapping the rank's computation."""
        with _FUTURE_LOCK:
            if self._future is not None:
                return self._future
            future = self._future = OrderedFuture(self.wait_done)
            done = self._done.is_set()
        if done:
            self._complete(future)
        return future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or `timeout` seconds); raise the operation's error. Returns True, like torch."""
        self.wait_done(timeout)
        if self._error is not None:
            raise self._error
        return True

    def wait_done(self, timeout: float | None = None) -> None:
        """Block until done (or `timeout` seconds), without raising the operation's own error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            if self._abort is not None:
                self._abort.raise_if_set()
            remaining = (
                POLL_INTERVAL_S if deadline is None else min(POLL_INTERVAL_S, deadline - time.monotonic())
            )
            if remaining <= 0:
                raise CollectiveTimeoutError(f"{self._description} did not complete within {timeout} s")
            self._done.wait(remaining)

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        if self._error is not None:
            state = f"failed: {type(self._error).__name__}"
        return f"<Work {self._description} ({state})>"


class CompletedWork(Work):
    """A Work that is already done (ops that finish at issue time, such as a buffered send)."""

    __slots__ = ()

    def __init__(self, description: str | LazyText, result: Any = None) -> None:
        super().__init__(description)
        self._finish(result)


class LazyWork(Work):
    """A Work whose completion is performed by the first `wait()` (e.g. a receive from a mailbox)."""

    __slots__ = ("_lock", "_perform", "_probe")

    def __init__(
        self, description: str | LazyText, complete: Callable[[float | None], Any], probe: Callable[[], bool]
    ):
        super().__init__(description)
        self._perform = complete  # (not `_complete`: that is Work's method that completes the future)
        self._probe = probe
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._probe():
            self.wait_done()  # the message is there: complete now so the tensor is valid once this says True
        return self._done.is_set()

    def wait_done(self, timeout: float | None = None) -> None:
        """Perform the completion (once; the op's error is kept for `wait()`, a timeout is raised)."""
        with self._lock:
            if not self._done.is_set():
                try:
                    self._finish(self._perform(timeout))
                except CollectiveTimeoutError:
                    raise  # not done yet: a later wait() may still succeed
                except BaseException as error:
                    self._finish(error=error)
