"""`NcclWork`: the Work of an asynchronous operation the nccl backend enqueued (torch's WorkNCCL).

The operation was issued when the call returned (no member waits for another); its done event, recorded on
the stream it ran on, completes once the device has run it, which needs every peer's matching call.

- `wait()`: makes the caller's current stream wait for the done event; the host does not wait for the device
  (cudaStreamWaitEvent), nor for the peers. A barrier's Work is the exception: its wait is a host wait, as
  torch's barrier synchronizes (ProcessGroupNCCL::barrier).
- `wait(timeout)` and `synchronize()`: the host waits for the device too, polling the done event with short
  sleeps, checking NCCL's asynchronous error and the launch's stop signal in between, and raising a clear
  timeout.
- `is_completed()`: the done event has completed; never blocks.

The asynchronous error is asked of the member's NcclComm, never of a raw handle: an aborted communicator is
freed, and NcclComm answers for it without touching NCCL (comm.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from threadpar.comm.common import graph_capture
from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import CudaApi
from threadpar.comm.common.work import LazyText, Work
from threadpar.comm.nccl.comm import NcclComm
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
    __slots__ = (
        "_blocking",
        "_comm",
        "_cuda",
        "_device",
        "_done_event",
        "_gate",
        "_health",
        "_late",
        "_timeout",
    )

    def __init__(
        self,
        description: str | LazyText,
        *,
        cuda: CudaApi,
        device: torch.device,
        abort: AbortSignal,
        timeout: float,
        done: Any,
        comm: NcclComm | None = None,
        health: CliqueHealth | None = None,
        blocking: bool = False,
        gate: Any = None,
        late: Callable[[], str] | None = None,
    ) -> None:
        """`gate`: for an operation not yet issued when the Work was made (a send whose pair's communicators
        are still being made, p2p.py): `gate.is_set()` once it is, `gate.wait(timeout, abort)` waits."""
        # Work's fields, without the threading.Event Work.__init__ makes (it costs more than the rest).
        # (_Flag is not a threading.Event: NcclWork overrides wait and is_completed, the users of _done
        # other than wait_done, which only the threads backend's comm worker calls, on its own Works.)
        self._description, self._abort, self._done = description, abort, _Flag()  # type: ignore[assignment]
        self._error: BaseException | None = None
        self._result: Any = None
        self._future = None
        self._cuda = cuda  # for the caller's current stream
        self._device = device
        self._timeout = timeout  # for synchronize(), which has no timeout argument
        self._done_event = done  # recorded on the op's stream right after it
        self._comm = comm  # the member's communicator, for the asynchronous error check
        self._health = health  # the group's: told of any failure or timeout (its clique is then not reused)
        self._blocking = blocking  # a barrier: wait() waits on the host
        self._gate = gate
        self._late = late  # what a timeout says of the peers (the group's ledger: who has not issued it)

    def _fail(self, error: BaseException) -> BaseException:
        self._spoil(error)
        self._finish(error=error)
        return error

    def _spoil(self, error: BaseException) -> None:
        if self._health is not None:
            self._health.spoil(f"{self._description}: {type(error).__name__}")

    def _check_aborted(self) -> None:
        """An operation of an aborted communicator never ran to its end, though its done event completes (its
        kernel was ended): never a success (one seen done before the abort stays done)."""
        comm = self._comm
        aborted = None if comm is None else comm.aborted
        if comm is not None and aborted is not None:
            raise self._fail(
                NcclError(
                    f"{self._description} did not finish: the communicator of {comm.label} was {aborted}"
                )
            )

    def _check_async_error(self) -> None:
        self._check_aborted()
        message = None if self._comm is None else self._comm.async_error()
        if message is not None:
            raise self._fail(
                NcclError(f"{self._description} failed on the device: {message} (an asynchronous NCCL error)")
            )

    def _device_done(self) -> bool:
        try:
            return bool(self._done_event.query())
        except RuntimeError as error:  # a CUDA error surfaced by the event (e.g. a failed kernel)
            raise self._fail(NcclError(f"{self._description} failed on the device: {error}")) from error

    def is_completed(self) -> bool:
        if self._done.is_set():
            return True
        if self._gate is not None and not self._gate.is_set():
            return False
        try:
            self._check_async_error()
            if not self._device_done():
                return False
        except Exception:
            return self._done.is_set()  # failed: completed, unsuccessfully
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """No timeout: order the caller's current stream after the operation (the host does not wait for the
        device). With a timeout (seconds), or for a barrier: block the host until the device has run it."""
        if timeout is not None or self._blocking:
            graph_capture.refuse(
                f"{self._description}: a wait of the host for the device (a barrier, or wait(timeout=...))",
                "the host cannot wait for a captured operation (it runs at each replay); leave it out of the graphed step",
            )
            self._block(self._timeout if timeout is None else timeout)
            return True
        if self._error is not None:
            raise self._error
        self._issued(self._timeout)
        if not self._done.is_set():
            self._check_aborted()
        self._cuda.current_stream(self._device).wait_event(self._done_event)
        return True

    def _issued(self, timeout: float) -> None:
        """Wait until the operation was issued (only a gated one may not be yet)."""
        if self._gate is not None and not self._gate.is_set():
            try:
                self._gate.wait(timeout, self._abort)
            except Exception as error:
                raise self._fail(error) from None
        elif self._gate is not None:
            self._gate.wait(0, self._abort)  # (raises what failed it, if anything did)

    def synchronize(self) -> None:
        """Block the host until the device has finished the operation (at most the launch's timeout)."""
        self._block(self._timeout)

    def _block(self, timeout: float) -> None:
        if self._error is not None:
            raise self._error
        self._issued(timeout)
        deadline = time.monotonic() + timeout
        sleep = POLL_FIRST_S
        while not self._device_done():
            self._check_async_error()
            if self._abort is not None:
                self._abort.raise_if_set()
            if time.monotonic() >= deadline:
                late = "" if self._late is None else self._late()
                error = CollectiveTimeoutError(
                    f"{self._description} timed out after {timeout:g} s waiting for the device to finish it: "
                    + (
                        late
                        if late
                        else "a peer has not issued its part, its stream is stuck behind other work, or the NCCL "
                        "kernel hangs (NCCL_DEBUG=INFO shows what it waits for)"
                    )
                )
                self._spoil(error)  # not failed (a later wait may still succeed), but never pooled
                raise error
            time.sleep(sleep)
            sleep = min(2 * sleep, POLL_MAX_S)
        self._check_async_error()
        self._finish()
