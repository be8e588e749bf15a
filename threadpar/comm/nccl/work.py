"""`NcclWork`: the Work of an operation the nccl backend enqueued on a comm stream (InfiniTrain's WorkNccl).

Two things must happen before its result may be used: every member has posted the call, so that the
leader could launch it (a host event), and the comm stream has run it (the done event, on the device).

- `wait()`: waits for the launch, then makes the caller's current stream wait for the done event; the host
  does not wait for the device (WaitNonBlocking: cudaStreamWaitEvent).
- `wait(timeout)` and `synchronize()`: the host waits for the device too, polling the done event with short
  sleeps, checking NCCL's asynchronous error and the launch's stop signal in between, and raising a clear
  timeout (WaitBlocking).
- `is_completed()`: launched and the done event has completed; never blocks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import NcclRuntime
from threadpar.comm.common.rendezvous import Arrival
from threadpar.comm.common.work import LazyText, Work
from threadpar.comm.nccl.resources import CliqueHealth
from threadpar.errors import CollectiveTimeoutError, NcclError

# First sleep between two polls of the done event (InfiniTrain sleeps 50 us); it doubles up to the cap so
# that a long wait does not take the GIL from the other rank threads thousands of times a second.
POLL_FIRST_S = 50e-6
POLL_MAX_S = 1e-3


class _Flag:
    """threading.Event's is_set/set without its lock: nobody waits on an NcclWork's flag."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = False

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        self._value = True


class NcclWork(Work):
    __slots__ = ("_arrival", "_comm", "_device", "_done_event", "_health", "_runtime", "_timeout")

    def __init__(
        self,
        description: str | LazyText,
        *,
        runtime: NcclRuntime,
        device: torch.device,
        abort: AbortSignal,
        timeout: float,
        arrival: Arrival | None = None,
        done: Any = None,
        comm: Any = None,
        health: CliqueHealth | None = None,
    ) -> None:
        # Work's fields, without the threading.Event Work.__init__ makes (it costs more than the rest).
        # (_Flag is not a threading.Event: NcclWork overrides wait and is_completed, the users of _done
        # other than wait_done, which only the threads backend's comm worker calls, on its own Works.)
        self._description, self._abort, self._done = description, abort, _Flag()  # type: ignore[assignment]
        self._error: BaseException | None = None
        self._result: Any = None
        self._future = None
        self._runtime = runtime  # its async-error query, and its CUDA primitives' current stream
        self._device = device
        self._timeout = timeout  # for synchronize(), which has no timeout argument
        self._arrival = arrival  # None: launched at issue time (a send)
        self._done_event = done  # None: nothing on the device to wait for (a barrier)
        self._comm = comm  # this member's communicator, for the asynchronous error check
        self._health = health  # the group's: told of any failure or timeout (its clique is then not reused)

    def _fail(self, error: BaseException) -> BaseException:
        self._spoil(error)
        self._finish(error=error)
        return error

    def _spoil(self, error: BaseException) -> None:
        if self._health is not None:
            self._health.spoil(f"{self._description}: {type(error).__name__}")

    def _launched(self, timeout: float | None) -> None:
        """Wait until the leader has launched the operation; raise what went wrong there."""
        if self._error is not None:
            raise self._error
        arrival = self._arrival  # (read once: another thread's wait may drop it)
        if arrival is not None:
            try:
                arrival.wait(timeout)
            except CollectiveTimeoutError as error:
                self._spoil(error)  # not failed (a later wait may still succeed), but never pooled
                raise
            except Exception as error:
                raise self._fail(error) from None
            self._arrival = None  # launched: the comm stream holds the tensors now (record_stream)

    def _check_async_error(self) -> None:
        if self._comm is None:
            return
        message = self._runtime.async_error(self._comm)
        if message is not None:
            raise self._fail(
                NcclError(f"{self._description} failed on the device: {message} (an asynchronous NCCL error)")
            )

    def _device_done(self) -> bool:
        if self._done_event is None:
            return True
        try:
            return bool(self._done_event.query())
        except RuntimeError as error:  # a CUDA error surfaced by the event (e.g. a failed kernel)
            raise self._fail(NcclError(f"{self._description} failed on the device: {error}")) from error

    def _spoiled_by(self, error: BaseException) -> BaseException:
        self._spoil(error)
        return error

    def is_completed(self) -> bool:
        if self._done.is_set():
            return True
        arrival = self._arrival
        if arrival is not None and not arrival.done():
            return False
        try:
            self._launched(0)
            self._check_async_error()
            if not self._device_done():
                return False
        except Exception:
            return self._done.is_set()  # failed: completed, unsuccessfully
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """No timeout: order the caller's current stream after the operation (the host does not wait for the
        device). With a timeout (seconds): block the host until the device has finished it."""
        if timeout is not None:
            self._block(timeout)
            return True
        self._launched(None)
        self._check_async_error()
        if self._done_event is not None:
            self._runtime.cuda.current_stream(self._device).wait_event(self._done_event)
        return True

    def synchronize(self) -> None:
        """Block the host until the device has finished the operation (at most the launch's timeout)."""
        self._block(self._timeout)

    def _block(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._launched(timeout)
        sleep = POLL_FIRST_S
        while not self._device_done():
            self._check_async_error()
            if self._abort is not None:
                self._abort.raise_if_set()
            if time.monotonic() >= deadline:
                raise self._spoiled_by(
                    CollectiveTimeoutError(
                        f"{self._description} was launched but the device did not finish it within {timeout:g} s; "
                        "a peer's stream may be stuck behind other work, or the NCCL kernel is hung "
                        "(NCCL_DEBUG=INFO shows what it waits for)"
                    )
                )
            time.sleep(sleep)
            sleep = min(2 * sleep, POLL_MAX_S)
        self._check_async_error()
        self._finish()
