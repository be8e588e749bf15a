"""Collectives matched in order (DESIGN.md rule 6), checked without any member waiting for another.

A backend whose members issue their own calls (nccl: each rank thread calls NCCL itself) cannot compare
the members' calls at a meeting, since there is none. Instead each member leaves its call's description
in the slot of its sequence number and goes on. The first member's call is the slot's reference: every
later member compares its own call with it and, if they differ, raises CollectiveMismatchError before it
issues its own (the others' kernels then wait for it on the device until the launch's stop aborts them).
The message names whose call differs from the majority's, whatever order the members came in
(comm/common/mismatch.py): the raising member, which will never issue, first waits a little (`wait_s`) for
the slot's other entries, so that a first entrant in the minority is named as such. Calls whose members legitimately
differ (all_to_all's split sizes) are compared whole by the member that completes the slot, before it
issues. A slot lives from its first entry to its last, so a member running ahead keeps one small slot per
call ahead.

No lock: every rank thread enters here on every collective, and a lock held by a thread the GIL preempted
makes every other member block on it, each block a GIL hand-off (measured: 2 context switches per
collective per rank at 8 ranks, up to 3x the host time of the same collectives without the check). Each step is
one operation of a built-in container instead, which both builds make atomic (rule 10; free-threaded
CPython: PEP 703's per-object locks, Doc/c-api/dict.rst for int keys): `dict.setdefault` decides the first
member of a slot, `list.append` records each entry, the length read after one's own append shows a
complete slot to at least its last entrant, and `dict.pop` hands it to exactly one completer.

The open slots also say who is late: `overdue` lists the calls some members issued longer than a timeout
ago that others have not (the nccl watchdog names them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from threadpar.comm.common import mismatch
from threadpar.comm.common.abort import AbortSignal
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
    __slots__ = ("entries", "first", "since")

    def __init__(self, member: int, call: Call) -> None:
        self.first = call  # the first entrant's call: every later one compares with it
        # Who entered, in the order they came; only ever appended to: a member whose call equals `first`
        # as its bare index (no allocation per entry: a rank running ahead keeps many slots alive, and
        # allocations that outlive a collection make the GC walk the whole heap, ~0.2 s with torch loaded),
        # one whose call legitimately differs (all_to_all's sizes) as (member, call).
        self.entries: list[int | tuple[int, Call]] = [member]
        self.since = time.monotonic()

    def calls(self) -> list[tuple[int, Call]]:
        """(member, call) of every entrant so far, in member order."""
        out = [e if isinstance(e, tuple) else (e, self.first) for e in list(self.entries)]
        return sorted(out, key=lambda e: e[0])

    def entered(self) -> set[int]:
        return {e[0] if isinstance(e, tuple) else e for e in list(self.entries)}


class CallLedger:
    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        group_ranks: Sequence[int] | None = None,
        *,
        wait_s: float = 0.0,
        abort: AbortSignal | None = None,
    ) -> None:
        """`ranks`: the global ranks of the members that enter here (in member order); `group_ranks`: the
        whole group's, when some members live in other processes (messages name the group by them).
        `wait_s`: how long a member whose call differs waits for the others' entries before it raises (so
        that the message names the minority), cut short by `abort`."""
        self.name = name
        self._wait_s = wait_s
        self._abort = abort
        self.ranks = tuple(ranks)
        self.group_ranks = self.ranks if group_ranks is None else tuple(group_ranks)
        self.size = len(self.ranks)
        self._members = [self.group_ranks.index(r) for r in self.ranks]  # group index of each entry
        self._slots: dict[int, _Slot] = {}  # open calls by sequence number (see the module's doc)
        self._compare: dict[str, Compare] = {}  # (filled before the group's first call)

    def compare_with(self, op: str, compare: Compare) -> None:
        """Calls of `op` go together when `compare` says so (default: when they are equal)."""
        self._compare[op] = compare

    def enter(self, member: int, seq: int, call: Call) -> bool:
        """Leave this member's call #seq; returns True on the one member that completed the slot (every
        member entered). Raises CollectiveMismatchError if this call cannot go with the slot's."""
        if self.size == 1:
            return True
        fresh = None
        slot = self._slots.get(seq)
        if slot is None:  # (as far as this member knows, the first: made only then, to spare the GC)
            fresh = _Slot(member, call)
            slot = self._slots.setdefault(seq, fresh)
        if slot is not fresh:
            first = slot.first
            if call == first:
                slot.entries.append(member)
            elif call.op == first.op and call.op in self._compare:
                slot.entries.append((member, call))  # (compared whole once complete)
            else:  # (entered as a differing call: this member never issues it)
                slot.entries.append((member, call))
                raise CollectiveMismatchError(self._describe(seq, self._settled(slot), "differ"))
        if len(slot.entries) < self.size or self._slots.pop(seq, None) is not slot:
            return False
        entries = slot.calls()  # (complete: every member's)
        calls = [c for _, c in entries]
        compare = self._compare.get(slot.first.op)
        if compare is not None and any(c != slot.first for c in calls):
            problem = compare(calls, self._members) if all(c.op == calls[0].op for c in calls) else "differ"
            if problem is not None:
                raise CollectiveMismatchError(self._describe(seq, entries, problem))
        return True

    def _settled(self, slot: _Slot) -> list[tuple[int, Call]]:
        """The slot's entries once every member entered, or `wait_s` passed, or the launch stopped."""
        deadline = time.monotonic() + self._wait_s
        while len(slot.entered()) < self.size and time.monotonic() < deadline:
            if self._abort is not None and self._abort.is_set:
                break
            time.sleep(0.001)
        return slot.calls()

    def missing(self, seq: int) -> list[int]:
        """The global ranks that have not entered call #seq while some have (empty: all or none have)."""
        slot = self._slots.get(seq)
        if slot is None:
            return []
        entered = slot.entered()
        return [r for m, r in enumerate(self.ranks) if m not in entered]

    def overdue(self, timeout: float, now: float | None = None) -> list[Overdue]:
        """The open calls whose first member issued them more than `timeout` seconds ago."""
        now = time.monotonic() if now is None else now
        out = []
        for seq, slot in sorted(self._slots.copy().items()):
            if now - slot.since <= timeout:
                continue
            entered = slot.entered()
            issued = [r for m, r in enumerate(self.ranks) if m in entered]
            missing = [r for m, r in enumerate(self.ranks) if m not in entered]
            out.append(Overdue(seq, slot.first, issued, missing, slot.since))
        return out

    def _describe(self, seq: int, entries: list[tuple[int, Call]], problem: str) -> str:
        """`entries`: (member, call) of the members that entered."""
        entered = {m for m, _ in entries}
        members = [(f"rank {self.ranks[m]}", call, str(call)) for m, call in entries]
        missing = [f"rank {r}" for m, r in enumerate(self.ranks) if m not in entered]
        lines = [mismatch.header(self.name, self.group_ranks, seq), *mismatch.member_lines(members, missing)]
        if problem != "differ":
            lines.append(problem)
        return "\n".join(lines)
