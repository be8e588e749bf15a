"""The CUDA graph captures of one launch's ranks in this process, taken one at a time (threadpar.cuda_graphs).

torch allows one capture underway per process (docs notes/cuda.rst, "Constraints"; the caching allocator
asserts `captures_underway.empty()` when a capture begins: c10/cuda/CUDACachingAllocator.cpp), and no
non-captured CUDA work from other threads during it. So the process's ranks capture in turns: every rank
arrives (its warm-up done), then they capture in rank order while the others wait here on the host (parked:
no CUDA calls), and none replays before all have captured. A rank's k-th capture pairs with every other
rank's k-th. Whether concurrent thread-local captures on distinct GPUs are safe is for a GPU to show; until
then this is the safe order. Launches running side by side in one process (a notebook's, a test's) take turns
with each other too: a capture holds the process's NCCL watchdog paused (cuda_graphs/step.py), whose lock is
the process's (one NcclRuntime per process: comm/nccl/cuda_api.py), so the rule is the process's, as torch's
is (tests/test_cuda_graphs.py pins it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from threadpar.comm.common.abort import AbortSignal
from threadpar.errors import CollectiveTimeoutError

T = TypeVar("T")


class _Round:
    __slots__ = ("arrived", "done", "left")

    def __init__(self) -> None:
        self.arrived: set[int] = set()
        self.done: set[int] = set()
        self.left = 0  # ranks that have gone on (the last one drops the round)


class CaptureTurns:
    def __init__(self, ranks: Sequence[int], abort: AbortSignal, timeout: float) -> None:
        self._ranks = tuple(ranks)
        self._abort = abort
        self._timeout = timeout
        self._cond = threading.Condition()  # guards _rounds and _count
        self._rounds: dict[int, _Round] = {}
        self._count: dict[int, int] = {}  # rank -> captures it has begun
        abort.register(self._cond)

    def take(self, rank: int, capture: Callable[[], T]) -> T:
        """Run `capture()` on this rank's turn; return once every rank has captured."""
        with self._cond:
            number = self._count.get(rank, 0)
            self._count[rank] = number + 1
            turn = self._rounds.setdefault(number, _Round())
            turn.arrived.add(rank)
            self._cond.notify_all()
            self._wait(
                lambda: len(turn.arrived) == len(self._ranks) and self._next(turn) == rank,
                rank,
                lambda: f"ranks {sorted(set(self._ranks) - turn.arrived)} to reach their CUDA graph capture",
            )
        try:
            result = capture()
        except BaseException:
            with self._cond:  # (the next rank's turn; this one's failure stops the launch)
                turn.done.add(rank)
                self._leave(number, turn)
                self._cond.notify_all()
            raise
        with self._cond:
            turn.done.add(rank)
            self._cond.notify_all()
            try:
                self._wait(
                    lambda: len(turn.done) == len(self._ranks),
                    rank,
                    lambda: f"ranks {sorted(set(self._ranks) - turn.done)} to finish their captures",
                )
            finally:
                self._leave(number, turn)
        return result

    def _leave(self, number: int, turn: _Round) -> None:
        turn.left += 1
        if turn.left == len(self._ranks):
            del self._rounds[number]

    def _next(self, turn: _Round) -> int:
        return min(r for r in self._ranks if r not in turn.done)

    def _wait(self, ready: Callable[[], bool], rank: int, missing: Callable[[], str]) -> None:
        deadline = time.monotonic() + self._timeout
        while not ready():
            self._abort.raise_if_set()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CollectiveTimeoutError(
                    f"rank {rank} waited {self._timeout:g} s for {missing()}: every rank of a launch in this "
                    "process captures its graphed step at the same call (the captures take turns), so every "
                    "rank must call it the same number of times"
                )
            self._cond.wait(remaining)
