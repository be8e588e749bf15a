"""Whether the calling thread is capturing a CUDA graph, for the code that must refuse to be captured.

A captured step's Python runs once, at capture; what it asks of the host then (a meeting of the group's
members to make its communicators, a wait for a peer's point-to-point announcement) is not in the graph and
would deadlock the captures, which run one rank at a time (turns.py). Such code calls `refuse(...)`, which
raises GraphCaptureError naming what to do instead. The flag is thread-local: a rank captures on its own
thread (threadpar captures with capture_error_mode="thread_local").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from threadpar.errors import GraphCaptureError

_local = threading.local()


def capturing() -> bool:
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """The calling thread is capturing while inside."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def refuse(what: str, instead: str) -> None:
    """Raise if the calling thread is capturing: `what` cannot be in a CUDA graph; `instead`: how to fix it."""
    if capturing():
        raise GraphCaptureError(f"{what} inside a step being captured as a CUDA graph: {instead}")
