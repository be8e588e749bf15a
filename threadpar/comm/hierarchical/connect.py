"""A group's gloo group being connected, waited on like a gloo operation.

Creating a `ProcessGroupGloo` meets the other processes (gloo's connectFullMesh, through the store) and
blocks until they all come or gloo's own timeout passes; neither a stop of the launch nor threadpar's
timeout interrupts it. A process whose ranks never reach the group's first collective thus left the others
blocked in that constructor, to fail later with gloo's store error, naming no rank. So the constructor
runs on a helper thread (it releases the GIL while it waits), and the checker waits for it as for any gloo
operation (`gloo_ops.wait_work`): a stop interrupts the wait, and at threadpar's deadline the timeout
names the ranks that did not arrive. A helper given up on stays blocked until gloo's timeout, then ends.
Once connected, the helper is joined before the group is used: its teardown drops its hold on the gloo
group, which must not be destroyed on it later, perhaps during interpreter exit (runtime/launch.py).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

# The message of the RuntimeError a gloo Work's wait(timeout) raises when the timeout passes first (a
# string of torch 2.13's libtorch_cpu, from c10d's ProcessGroupGloo); wait_work polls on it.
GLOO_TIMED_OUT = "Operation timed out!"


class Connecting:
    """`connect()` running on its own thread; `wait(timeout)` behaves as a gloo Work's."""

    def __init__(self, name: str, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._done = threading.Event()  # set after _group or _error is written
        self._group: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"threadpar-gloo-connect-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._group = self._connect()
        except BaseException as error:
            self._error = error
        finally:
            self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(GLOO_TIMED_OUT)
        self._thread.join()  # only its teardown is left
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        """The connected gloo group (after `wait` returned)."""
        assert self._done.is_set() and self._error is None
        return self._group
