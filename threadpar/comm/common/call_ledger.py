"""Collectives matched in order (DESIGN.md rule 6), checked without any member waiting for another.

A backend whose members issue their own calls (nccl: each rank thread calls NCCL itself) cannot compare
the members' calls at a meeting, since there is none. Instead each member leaves its call's description
in the slot of its sequence number and goes on; the member that completes a slot compares the descriptions
and, if they differ, raises CollectiveMismatchError naming every member's call before it issues its own
(the others' kernels then wait for it on the device until the launch's stop aborts them). A slot lives
from its first entry to its last, so a member running ahead keeps one small slot per call ahead.

The open slots also say who is late: `overdue` lists the calls some members issued longer than a timeout
ago that others have not (the nccl watchdog names them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from threadpar.comm.common.rendezvous import Call
from threadpar.errors import CollectiveMismatchError

# compare(calls, members) -> None if they go together, else why not (a line per problem); `calls[i]` is
# the call of the group's member `members[i]` (a spanning group's ledger holds this process's members only).
Compare = Callable[[list[Call], list[int]], str | None]


class Overdue(NamedTuple):
    seq: int
    call: Call  # what the members that issued it called
    issued: list[int]  # their global ranks
    missing: list[int]  # the global ranks that have not issued it
    since: float  # time.monotonic() of its first entry


class _Slot:
    __slots__ = ("calls", "count", "since")

    def __init__(self, size: int) -> None:
        self.calls: list[Call | None] = [None] * size
        self.count = 0
        self.since = time.monotonic()


class CallLedger:
    def __init__(self, name: str, ranks: Sequence[int], group_ranks: Sequence[int] | None = None) -> None:
        """`ranks`: the global ranks of the members that enter here (in member order); `group_ranks`: the
        whole group's, when some members live in other processes (messages name the group by them)."""
        self.name = name
        self.ranks = tuple(ranks)
        self.group_ranks = self.ranks if group_ranks is None else tuple(group_ranks)
        self.size = len(self.ranks)
        self._members = [self.group_ranks.index(r) for r in self.ranks]  # group index of each entry
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._compare: dict[str, Compare] = {}

    def compare_with(self, op: str, compare: Compare) -> None:
        """Calls of `op` go together when `compare` says so (default: when they are equal)."""
        self._compare[op] = compare

    def enter(self, member: int, seq: int, call: Call) -> bool:
        """Leave this member's call #seq; returns True if this completed the slot (every member entered).
        Raises CollectiveMismatchError on the member that completes a slot whose calls differ."""
        if self.size == 1:
            return True
        with self._lock:
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(self.size)
            slot.calls[member] = call
            slot.count += 1
            if slot.count < self.size:
                return False
            del self._slots[seq]
        calls: list[Call] = slot.calls  # type: ignore[assignment]  # (complete: no None left)
        first = calls[0]
        if all(c == first for c in calls):
            return True
        compare = self._compare.get(first.op)
        same_op = compare is not None and all(c.op == first.op for c in calls)
        problem = compare(calls, self._members) if same_op else "differ"  # type: ignore[misc]
        if problem is not None:
            raise CollectiveMismatchError(self._describe(seq, calls, problem))
        return True

    def missing(self, seq: int) -> list[int]:
        """The global ranks that have not entered call #seq while some have (empty: all or none have)."""
        with self._lock:
            slot = self._slots.get(seq)
            return [] if slot is None else [self.ranks[m] for m, c in enumerate(slot.calls) if c is None]

    def overdue(self, timeout: float, now: float | None = None) -> list[Overdue]:
        """The open calls whose first member issued them more than `timeout` seconds ago."""
        now = time.monotonic() if now is None else now
        with self._lock:  # (copies of the late slots: read outside the lock)
            late = [
                (seq, s.since, list(s.calls)) for seq, s in self._slots.items() if now - s.since > timeout
            ]
        out = []
        for seq, since, calls in sorted(late):
            issued = [self.ranks[m] for m, c in enumerate(calls) if c is not None]
            missing = [self.ranks[m] for m, c in enumerate(calls) if c is None]
            call = next(c for c in calls if c is not None)
            out.append(Overdue(seq, call, issued, missing, since))
        return out

    def _describe(self, seq: int, calls: list[Call], problem: str) -> str:
        lines = [
            f"collective mismatch on group '{self.name}' (global ranks {list(self.group_ranks)}) at its call #{seq}: "
            "members must call the same collectives, with the same dtypes and shapes, in the same order"
        ]
        first = calls[0]
        for m, call in enumerate(calls):
            mark = "" if call == first else "   <-- differs from rank " + str(self.ranks[0])
            lines.append(f"  rank {self.ranks[m]}: {call}{mark}")
        if problem != "differ":
            lines.append(problem)
        return "\n".join(lines)
