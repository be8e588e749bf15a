"""Running the NCCL calls that block the host until the peers come, without letting them hang a rank.

Three NCCL calls wait on the host for other ranks: ncclCommInitRank (until every rank of the unique id has
joined, nccl.h), and the first operation that needs a connection NCCL makes lazily: point-to-point
connections are always made on first use, and with NCCL_RUNTIME_CONNECT=1 (NCCL >= 2.22's default) a
collective algorithm's too; the group end then blocks until the peers make the same connection
(src/enqueue.cc, src/transport.cc). On a blocking communicator none of them has a timeout, and none can be
aborted: there is no handle to abort during an init, and ncclCommAbort must not run while another thread is
inside NCCL on the communicator (user guide, "Fault Tolerance").

A nonblocking communicator (config.blocking = 0) could be polled and aborted, but from NCCL 2.23 every
group end on one hands the launch to a new pthread and returns ncclInProgress, after which nothing may be
enqueued on its streams until a poll says ncclSuccess (src/group.cc, ncclGroupEndInternal; api/comms.html):
that costs more than a small collective itself, on every operation. So threadpar's communicators are blocking,
and these calls run only after every member of the group (in this process; across processes after they agree
through the store) has arrived, on a helper thread, while the member waits for it bounded by the launch's
timeout and its stop signal. If that wait gives up (a peer process died in between), the helper is left in
NCCL, holding its device's launch lock, as a rank thread stuck in native code is left after a stop; should
its call ever return, it aborts what it made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from threadpar.comm.common.abort import POLL_INTERVAL_S, AbortSignal
from threadpar.errors import CollectiveTimeoutError

T = TypeVar("T")


class _Outcome(Generic[T]):
    __slots__ = ("done", "error", "given_up", "lock", "value")

    def __init__(self) -> None:
        self.done = threading.Event()  # set after value/error are written (orders them before the reads)
        self.lock = threading.Lock()  # the hand-over between a late helper and a member that gave up
        self.value: T | None = None
        self.error: BaseException | None = None
        self.given_up = False


def connect(
    what: str,
    call: Callable[[], T],
    *,
    abort: AbortSignal,
    timeout: float,
    describe_timeout: Callable[[], str],
    undo: Callable[[T], None] | None = None,
) -> T:
    """`call()` on a helper thread; returns its result, or raises its error, a CollectiveTimeoutError
    (`describe_timeout()`) after `timeout` seconds, or RankAborted once the launch stops. `undo(result)`
    runs on the helper if the result comes after the caller gave up (e.g. abort a late communicator)."""
    outcome: _Outcome[T] = _Outcome()

    def run() -> None:
        try:
            value = call()
        except BaseException as error:  # handed to the caller, raised there
            outcome.error = error
            outcome.done.set()
            return
        with outcome.lock:
            late = outcome.given_up
            outcome.value = value
            outcome.done.set()
        if late and undo is not None:
            undo(value)

    helper = threading.Thread(target=run, name=f"threadpar-nccl-connect ({what})", daemon=True)
    helper.start()
    deadline = time.monotonic() + timeout
    while not outcome.done.wait(POLL_INTERVAL_S):
        stopped = abort.is_set
        if stopped or time.monotonic() >= deadline:
            with outcome.lock:
                if not outcome.done.is_set():
                    outcome.given_up = True
            if outcome.given_up:
                abort.raise_if_set()
                raise CollectiveTimeoutError(describe_timeout())
    helper.join()  # it has finished: only its teardown is left (DESIGN.md rule 5)
    if outcome.error is not None:
        raise outcome.error
    return outcome.value  # type: ignore[return-value]  # (set whenever error is None)
