"""`NcclComm`: one member's NCCL communicator, and the only way threadpar touches its handle.

Every C call on the handle (operations, the async-error query, abort, destroy) goes through this object,
which holds its device's launch lock around the call (DESIGN.md rule 7) and knows whether the handle is
still alive: ncclCommAbort and ncclCommDestroy free the communicator (NCCL's src/init.cc, commReclaim), so a
later call on the handle would read freed memory. After either, the object refuses every call with an
error that says why, and the async-error query answers from what it remembers. So a Work, the watchdog or a
late thread can never pass a freed handle to NCCL.

It also records what the watchdog needs to tell a hang (how many operations were issued, and on which
streams since its last look), under the same lock, so the fast path takes one lock per operation.

A nonblocking communicator (point to point's pairs, p2p.py: made and connected without any thread waiting
for a peer while it holds a lock) returns from a call that goes on in the background: from NCCL 2.23 every
group end on one hands the launch to a new thread of NCCL's and returns ncclInProgress (src/group.cc,
ncclGroupEndInternal: pthread_create(groupLaunchNonBlocking), ret = ncclInProgress), and nothing may be
issued on it, nor on the streams it uses, until ncclCommGetAsyncError says ncclSuccess (nccl.h, user guide
api/comms.html; src/init.cc, ncclCommEnsureReady refuses a call before that). `launch` issues under the
lock and then waits for that WITHOUT the lock, as torch does (torch/csrc/cuda/nccl.cpp, NCCL_CHECK_TIMEOUT:
sched_yield between polls of ncclCommGetAsyncError, bounded by a timeout): each poll takes the lock for the
query alone, so the device's other threads (its rank thread's other groups, autograd's device thread, the
watchdog) are never held behind NCCL's launch thread. Whoever launches on a nonblocking communicator owns
it until that wait ends (p2p.py's link and posting locks: one issuer per pair communicator). `settle` waits
the same way, sleeping between polls, for what may wait for a peer (a creation, a first connection).

It owns the reductions made on its handle (ncclRedOpCreatePreMulSum: fp16/bf16 AVG, nccl/reduction.py): an
ncclRedOp_t of one communicator and one data type (src/enqueue.cc, hostToDevRedOp refuses another type;
src/misc/argcheck.cc, ArgsCheck, an op unknown to the communicator), made at its first use, inside the
launch, under the lock; destroyed before ncclCommDestroy (nccl.h: allowed once the last call given it has
returned). An abort does not destroy them: ncclCommAbort's commFree deletes the communicator's table of them
(src/init.cc, `delete[] comm->userRedOps`), and the abort stays one call.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from threadpar.comm.common import graph_capture
from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.nccl.library import IN_PROGRESS, SUCCESS, async_error_text
from threadpar.errors import CollectiveTimeoutError, NcclError

# How often `settle` asks whether a nonblocking communicator's creation or first connection is done (it waits
# for the peer; torch's ProcessGroupNCCL waitReady sleeps 2 ms between its polls).
SETTLE_POLL_S = 1e-3
# A launch on a nonblocking communicator: NCCL's own thread plans and enqueues it (tens of microseconds), so
# the wait for it yields between polls (torch: sched_yield); after this many polls it sleeps between them
# instead, so that a slow launch on a busy machine does not take a core from the threads that run it.
SPIN_POLLS = 200
SPIN_SLEEP_S = 5e-5
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))  # (releases the GIL: posixmodule.c)


class ScaledSumIssue(NamedTuple):
    """An operation whose ncclRedOp_t is this communicator's pre-multiplied sum for (dtype, scalar):
    `call(handle, op)` makes its NCCL calls (a plain issue is `issue(handle)`)."""

    dtype: torch.dtype
    scalar: float
    call: Callable[[Any, int], None]


class NcclComm:
    __slots__ = (
        "_freed", "_user_ops", "_waits", "blocking", "device", "issued", "label", "lock", "nccl", "raw",
        "streams_used",
    )  # fmt: skip

    def __init__(
        self,
        raw: Any,
        nccl: Any,
        device: Any,
        lock: threading.Lock,
        label: str,
        blocking: bool = True,
        waits: tuple[AbortSignal, float] | None = None,
    ) -> None:
        """`waits`: for a nonblocking communicator, the launch's stop signal and timeout, which bound the
        wait after each of its launches."""
        self.raw = raw  # the binding's Communicator (or the double's FakeComm): read only under `lock`
        self.nccl = nccl  # NCCL's C API (library.NcclLibrary or the double's FakeNccl)
        self.device = device  # the CUDA device index it is bound to
        self.lock = lock  # its device's launch lock (resources.DeviceLocks)
        self.label = label  # e.g. "rank 3 in group 'TP1'", for messages
        self._freed: str | None = None  # why the handle is gone ("aborted: ...", "destroyed"), once it is
        self.issued = 0  # operations issued on it (the watchdog compares it with what it has probed)
        self.streams_used: set[Any] = set()  # streams those went to since the watchdog last looked
        self.blocking = blocking  # False: its calls may go on in the background (see the module docstring)
        if not blocking and waits is None:
            raise ValueError("a nonblocking NcclComm needs waits=(abort, timeout) to bound its launches")
        self._waits = waits
        # (dtype, scalar) -> the ncclRedOp_t made on the handle (module docstring): under `lock`
        self._user_ops: dict[tuple[torch.dtype, float], int] = {}

    # the fast path ----------------------------------------------------------------------------------------------
    def launch(self, issue: Callable[[Any], None] | ScaledSumIssue, *streams: Any) -> None:
        """`issue(handle)` makes this member's NCCL calls of one operation (a single call, or a group of
        them: every call of a group must come from one thread, nccl.h) on `streams`. On a nonblocking
        communicator it returns once NCCL's launch thread is done (module docstring), having held the lock
        only for the calls and each poll."""
        with self.lock:
            self.launch_locked(issue, streams)
        if not self.blocking:
            self._await_launch()

    def launch_locked(self, issue: Callable[[Any], None] | ScaledSumIssue, streams: tuple[Any, ...]) -> None:
        """`launch` by a caller that holds `lock` already (a connector making a blocking communicator); on a
        nonblocking one the caller then waits with `_await_launch`, after letting go of the lock."""
        if self._freed is not None:
            raise NcclError(
                f"an NCCL call on the communicator of {self.label}, which was {self._freed}: the launch is stopping"
            )
        if isinstance(issue, ScaledSumIssue):
            issue.call(self.raw, self._scaled_sum_op(issue.dtype, issue.scalar))
        else:
            issue(self.raw)
        if not graph_capture.capturing():  # (captured: not on the device; its replays are watched apart)
            self.issued += 1
            self.streams_used.update(streams)

    def _scaled_sum_op(self, dtype: torch.dtype, scalar: float) -> int:
        """The handle's pre-multiplied sum for (dtype, scalar), made at its first use (the caller holds the
        lock: ncclRedOpCreatePreMulSum writes the communicator's table of ops, src/enqueue.cc)."""
        op = self._user_ops.get((dtype, scalar))
        if op is None:
            op = self._user_ops[dtype, scalar] = self.nccl.red_op_create_pre_mul_sum(scalar, dtype, self.raw)
        return op

    def _await_launch(self) -> None:
        """Wait, without the lock, until NCCL's launch thread is done with this communicator's last call: a
        poll of ncclCommGetAsyncError under the lock, a yield between polls (torch's NCCL_CHECK_TIMEOUT),
        bounded by the launch's timeout and ended by its stop."""
        assert self._waits is not None  # (a nonblocking communicator has them: __init__)
        abort, timeout = self._waits
        polls, deadline = 0, 0.0
        while True:
            with self.lock:
                if self._freed is not None:
                    raise NcclError(f"the communicator of {self.label} was {self._freed} during its launch")
                if self._state() != IN_PROGRESS:
                    return
            polls += 1
            if polls == 1:
                deadline = time.monotonic() + timeout
            elif polls % 64 == 0:  # (the clock and the stop, every few polls: the fast path stays short)
                abort.raise_if_set()
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"an NCCL launch on the communicator of {self.label} was still in progress after "
                        f"{timeout:g} s (NCCL's launch thread never finished: NCCL_DEBUG=INFO says why)"
                    )
            if polls < SPIN_POLLS:
                _yield()
            else:
                time.sleep(SPIN_SLEEP_S)

    def settle(self, abort: AbortSignal, timeout: float, describe_timeout: Callable[[], str]) -> None:
        """Wait until a nonblocking communicator's creation or last call is done (it may wait for the peer),
        asking under the lock at each poll only: bounded by `timeout`, ended by a stop (the caller then
        aborts it, which NCCL allows at any point of a nonblocking communicator's life)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self._freed is not None:
                    raise NcclError(f"the communicator of {self.label} was {self._freed}")
                state = self._state()
            if state != IN_PROGRESS:
                return
            abort.raise_if_set()
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(describe_timeout())
            time.sleep(SETTLE_POLL_S)

    def _state(self) -> int:
        """ncclCommGetAsyncError (the caller holds the lock): ncclSuccess or ncclInProgress, else raises."""
        code = self.nccl.comm_get_async_error(self.raw)
        if code not in (SUCCESS, IN_PROGRESS):
            raise NcclError(
                f"NCCL failed on the communicator of {self.label}: {async_error_text(self.nccl, self.raw)}"
            )
        return code

    # the watchdog, the end of a launch ---------------------------------------------------------------------------
    def async_error(self, wait_s: float | None = None) -> str | None:
        """What ncclCommGetAsyncError reports, or None if all is well (also once the handle is gone: its
        operations were ended on purpose, and whoever ended them reported why). `wait_s`: the longest wait for
        the device's lock (None: no bound); a lock that does not come reads as nothing to report yet."""
        if not self.lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return None
        try:
            if self._freed is not None:
                return None
            return async_error_text(self.nccl, self.raw)
        finally:
            self.lock.release()

    def take_progress(self, wait_s: float | None = None) -> tuple[int, set[Any]] | None:
        """(operations issued so far, the streams used since the last call): the watchdog's view; None if the
        device's lock did not come within `wait_s` (None: no bound)."""
        if not self.lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return None
        try:
            used, self.streams_used = self.streams_used, set()
            return self.issued, used
        finally:
            self.lock.release()

    def abort(self, reason: str, timeout: float | None = None) -> bool:
        """ncclCommAbort: ends the operations still queued or running and frees the communicator (nccl.h).
        Waits for the device's lock (no other thread may be inside NCCL on it: "Fault Tolerance") at most
        `timeout` seconds; False if the lock did not come (a connector stuck in a blocking NCCL call holds
        it), leaving the communicator as it is."""
        if not self.lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            if self._freed is None:
                self._freed = f"aborted: {reason}"
                self._user_ops = {}  # (freed with it: the module docstring)
                self.nccl.comm_abort(self.raw)
        finally:
            self.lock.release()
        return True

    def destroy(self) -> None:
        """ncclCommDestroy: frees the communicator once its launched operations have finished (nccl.h; it
        waits for them: src/init.cc, commDestroySync), so only after every member issued all of its own."""
        with self.lock:
            if self._freed is None:
                self._freed = "destroyed"
                ops, self._user_ops = list(self._user_ops.values()), {}
                try:
                    for op in ops:  # (the launches given them have returned: we hold the lock)
                        self.nccl.red_op_destroy(op, self.raw)
                finally:
                    self.nccl.comm_destroy(self.raw)

    @property
    def alive(self) -> bool:
        return self._freed is None

    @property
    def aborted(self) -> str | None:
        """Why it was aborted ("aborted: <the launch's reason>"), or None: an operation not yet seen done then
        never ran to its end (ncclCommAbort ends it; its done event completes all the same)."""
        freed = self._freed  # (a write-once reference: DESIGN.md rule 10)
        return freed if freed is not None and freed.startswith("aborted") else None

    def __repr__(self) -> str:
        return f"<NcclComm {self.label} on device {self.device}{'' if self.alive else f' ({self._freed})'}>"
