"""Whether the calling thread is capturing a CUDA graph (or rehearsing for one), for the code that must know.

A captured step's Python runs once, at capture; what it asks of the host then (a meeting of the group's
members to make its communicators) is not in the graph and would deadlock the captures, which run one rank
at a time (capture_turns.py). Such code calls `refuse(...)`, which raises GraphCaptureError naming what to
do instead. Point to point needs more than a flag: a receive learns a message's shape from its sender's
announcement, which a capture cannot wait for; the step's last eager call before the capture is its
rehearsal, where the point-to-point layer notes what was sent and received (a `Script`), and the capture
follows that script (comm/nccl/p2p.py). Work a capture forks onto other streams registers a join
(`at_end`), run before the capture ends, also when the step raised inside it: CUDA refuses a capture with an
unjoined fork (error 904), an error that would replace the step's own (torch.cuda.graph's __exit__ ends the
capture either way) and leave the caching allocator with a capture underway (CUDAGraph::capture_end throws
before its pool's endAllocateToPool).

Both marks are thread-local: a rank captures on its own thread (capture_error_mode="thread_local"), and its
backward runs there during the rehearsal and the capture (cuda_graphs/step.py turns autograd's device
threads off for them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from threadpar.errors import GraphCaptureError, add_note

_local = threading.local()


class Script:
    """What one rank's step sent and received by point to point at its rehearsal, per (group, member, peer):
    the headers in send order (what the receiver's ncclRecv calls need: shape and dtype). Filled by the
    point-to-point layer; the capture consumes copies (`start`), so a later capture could follow it again."""

    def __init__(self) -> None:
        self.sent: dict[tuple[Any, int, int], list[Any]] = {}
        self.received: dict[tuple[Any, int, int], list[Any]] = {}
        self.to_send: dict[tuple[Any, int, int], list[Any]] = {}
        self.to_receive: dict[tuple[Any, int, int], list[Any]] = {}
        self.posted: dict[tuple[Any, int, int, int], list[Any]] = {}  # (group, member, src, tag) -> received
        # An event recorded on the capture's stream before the step: where receives fork from. A receive
        # writes a new buffer, so its ncclRecv needs nothing of the step's work before it, as in an eager step
        # (forked at the receive, it would follow the step's waits on its sends, which wait for the peer's
        # receives: a cycle when two ranks send each other a message before receiving, as a ring does).
        self.begin: Any = None

    def clear(self) -> None:
        self.sent.clear()
        self.received.clear()

    def start(self) -> None:
        """The capture begins: what it must send and receive is what the rehearsal did."""
        self.to_send = {k: list(v) for k, v in self.sent.items()}
        self.to_receive = {k: list(v) for k, v in self.received.items()}
        self.posted = {}

    def unfinished(self) -> list[str]:
        """What the rehearsal did and the capture did not (each peer's graph would wait for it at a replay)."""
        left = [f"{len(v)} send(s) to member {k[2]}" for k, v in self.to_send.items() if v]
        left += [f"{len(v)} receive(s) from member {k[2]}" for k, v in self.to_receive.items() if v]
        left += [
            f"{len(v)} received message(s) never taken (tag {k[3]})" for k, v in self.posted.items() if v
        ]
        return left


def capturing() -> bool:
    return getattr(_local, "capture", None) is not None  # (on every NCCL call: kept to one attribute read)


def capture_script() -> Script | None:
    """The script the calling thread's capture follows (None: not capturing)."""
    return getattr(_local, "capture", None)


def rehearsal_script() -> Script | None:
    """The script the calling thread's rehearsal fills (None: not rehearsing)."""
    return getattr(_local, "rehearsal", None)


@contextlib.contextmanager
def rehearsing(script: Script) -> Iterator[None]:
    """The calling thread runs the step's last eager call before its capture while inside."""
    script.clear()
    _local.rehearsal = script
    try:
        yield
    finally:
        _local.rehearsal = None


@contextlib.contextmanager
def marked(script: Script | None = None, begin: Any = None) -> Iterator[None]:
    """The calling thread is capturing while inside (open it inside the capture: the joins registered with
    `at_end` run at a normal exit, still captured). `begin`: an event recorded at the capture's start."""
    if capturing():
        raise GraphCaptureError("a graphed step called inside another's capture: graph the outer step only")
    script = Script() if script is None else script
    script.start()
    script.begin = begin
    _local.capture, _local.joins = script, []
    try:
        try:
            yield
        except BaseException as error:  # (the step's error is what the caller must see: joined still)
            try:
                _join(_local.joins)
            except Exception as join_error:
                add_note(error, f"joining the capture's forks failed too: {join_error}")
            raise
        _join(_local.joins)
        left = script.unfinished()
        if left:
            raise GraphCaptureError(
                "the captured step's point to point differs from its last eager call's (its rehearsal): "
                f"{'; '.join(left)}. A graphed step must send and receive the same messages at every call"
            )
    finally:
        _local.capture, _local.joins = None, []


def _join(joins: list[Callable[[], None]]) -> None:
    """Run every join (the first failure raised after all ran: a join left out is an unjoined fork)."""
    _local.joins = []
    failure: BaseException | None = None
    for join in joins:
        try:
            join()
        except BaseException as error:
            failure = failure or error
    if failure is not None:
        raise failure


def at_end(join: Callable[[], None]) -> None:
    """Run `join` before the calling thread's capture ends (it makes the origin stream wait for a fork)."""
    _local.joins.append(join)


def refuse(what: str, instead: str) -> None:
    """Raise if the calling thread is capturing: `what` cannot be in a CUDA graph; `instead`: how to fix it."""
    if capturing():
        raise GraphCaptureError(f"{what} inside a step being captured as a CUDA graph: {instead}")
