"""The process's NCCL watchdog: one thread that notices what no rank thread can, and stops the launch.

A rank thread never waits for its peers inside an NCCL call: the device does. So when a peer never issues
its part, or NCCL fails asynchronously (a network error, a peer process gone), nothing on the host raises
by itself: the kernels wait, and a rank that later synchronizes with the device waits with them. As torch's
ProcessGroupNCCL does (its watchdog thread polls every 100 ms: ncclCommGetAsyncError, each work's age, its
end event), one thread per process looks at every watched NCCL group every `INTERVAL_S` (group.py's
`watch_tick` does the looking: the async error of each communicator, the calls some members issued longer
ago than the timeout that others have not, and probe events that say whether the device still makes
progress) and reports what it finds as a rank's failure, which stops the launch.

It also does the aborting: when a launch stops (a rank's exception, a timeout, Ctrl-C, a process lost), its
groups' communicators are aborted (ncclCommAbort ends the kernels waiting for peers that will never come)
here, not on the thread that triggered the stop, which may be a rank thread in the middle of its own NCCL
call, holding its device's launch lock. The stop only wakes this thread.

The thread runs while any group is watched and ends when the last is unwatched (a launch's end joins it:
DESIGN.md rule 5).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

INTERVAL_S = 0.1  # torch's ProcessGroupNCCL: kWatchdogThreadSleepMillis = 100


class Watched(Protocol):
    def watch_tick(self, now: float) -> None:
        """Look at the group's communicators, report a failure, abort them after a stop."""


class Watchdog:
    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        self._lock = threading.Lock()  # guards _watched and _thread
        self._watched: dict[int, weakref.ref[Any]] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        # Held around each round of looks, and by a CUDA graph capture (`paused`): the looks record and query
        # events on the comm streams, which must not happen while a stream of this process is capturing.
        self._looking = threading.Lock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No look while inside (a capture: threadpar.cuda_graphs.step)."""
        with self._looking:
            yield

    def watch(self, group: Watched) -> None:
        with self._lock:
            self._watched[id(group)] = weakref.ref(group)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="threadpar-nccl-watchdog", daemon=True)
                self._thread.start()

    def unwatch(self, group: Watched) -> None:
        with self._lock:
            self._watched.pop(id(group), None)
        self._wake.set()

    def wake(self) -> None:
        """Look now (a launch stopped: its communicators are to be aborted)."""
        self._wake.set()

    def join_if_idle(self) -> None:
        """Wait for the thread to end if nothing is watched any more (the end of a launch)."""
        with self._lock:
            thread = self._thread if not self._watched else None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                groups = [ref() for ref in self._watched.values()]
                if not self._watched:
                    self._thread = None
                    return
            with self._looking:
                now = time.monotonic()
                for group in groups:
                    if group is not None:
                        group.watch_tick(now)
            groups = []  # (no reference kept across the sleep: a dropped group can go)
            group = None
            self._wake.wait(self.interval)
            self._wake.clear()
