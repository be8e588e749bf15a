"""The shared stop signal of one launch, and the one way threadpar waits: bounded, and woken by a stop.

Every blocking wait in threadpar (rendezvous, receive, Work.wait) goes through `wait_until`, so one rank's
failure or a Ctrl-C in the caller wakes every waiter at once instead of leaving it to its timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from threadpar.errors import CollectiveTimeoutError, RankAborted

# Waiters also re-check the signal this often, a safety net should a notification ever be missed.
POLL_INTERVAL_S = 0.25


class AbortSignal:
    """Set once, by the first failure or interrupt; then every registered waker is called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._wakers: list[Callable[[], None]] = []

    @property
    def is_set(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def register(self, condition: threading.Condition) -> None:
        """Wake the waiters of `condition` on a stop."""
        self.register_waker(lambda: _notify(condition))

    def register_waker(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.append(wake)

    def trigger(self, reason: str) -> bool:
        """Stop everything; returns False if the signal was already set (the first reason wins)."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            wakers = list(self._wakers)
        for wake in wakers:
            wake()
        return True

    def raise_if_set(self) -> None:
        if self._reason is not None:
            raise RankAborted(f"stopped: {self._reason}")


def _notify(condition: threading.Condition) -> None:
    # A bounded acquire: a waiter holds its condition only for short critical sections.
    if condition.acquire(timeout=1.0):
        try:
            condition.notify_all()
        finally:
            condition.release()


def wait_until(
    condition: threading.Condition,
    ready: Callable[[], bool],
    *,
    abort: AbortSignal,
    deadline: float,
    describe_timeout: Callable[[], str],
) -> None:
    """Wait on `condition` (held by the caller) until `ready()`; raise on abort or at `deadline`."""
    while not ready():
        abort.raise_if_set()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeoutError(describe_timeout())
        condition.wait(min(remaining, POLL_INTERVAL_S))
