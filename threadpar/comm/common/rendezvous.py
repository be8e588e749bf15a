"""Where the member threads of one group meet for each collective.

Every collective call of a member carries a sequence number (its count of collectives on this group) and
a description of the call. Members with the same sequence number meet in one slot; the last to arrive
checks that all described the same call (operation, dtype, shape, arguments), like NCCL's requirement
that members call collectives in the same order, and raises a mismatch on every member instead of
hanging or mixing data. A slot has numbered barriers (phases); algorithms that need more than one
meeting (reduce, then copy) call `sync` for the next phase. A stream-ordered backend (nccl) `post`s
instead: it does not wait for the others, and waits on the returned `Arrival` when its Work is waited on.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from threadpar.comm.common import mismatch
from threadpar.comm.common.abort import POLL_INTERVAL_S, AbortSignal
from threadpar.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NcclError,
    RankAborted,
    ThreadparError,
)


class Call(NamedTuple):
    """What one member asked for; members must agree on it."""

    op: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        args = []
        if self.dtype is not None:
            dtype = str(self.dtype).removeprefix("torch.")
            args.append(f"{dtype}{list(self.shape)}" if self.shape is not None else dtype)
        args += [f"{k}={v}" for k, v in self.extra]
        return f"{self.op}({', '.join(args)})"


class Slot:
    """The meeting of all members for one collective (one sequence number)."""

    __slots__ = (
        "arrived", "busy", "calls", "error", "finished", "payloads", "phase", "reached", "result", "shared",
        "waiters",
    )  # fmt: skip

    def __init__(self, size: int) -> None:
        self.calls: list[Call | None] = [None] * size
        self.payloads: list[Any] = [None] * size  # what each member brought (its tensors)
        self.shared: list[Any] = [None] * size  # what each member publishes for a later phase
        self.result: Any = None  # what a leader computed for everyone
        self.reached = [0] * size  # the last barrier each member has reached
        self.arrived = 0  # members waiting at the current barrier
        self.phase = 0  # barriers completed
        self.error: BaseException | str | None = None
        self.finished = False  # the leader did the whole collective; nothing is left for the members
        self.waiters: list[_thread.LockType] = []  # one locked lock per waiting member
        # Members in a bounded wait on the group's behalf (the cross-process step): the others wait for them.
        self.busy = [False] * size


class Rendezvous:
    """Waiting members block on a lock of their own that the last arrival releases, so a wake-up does not
    contend for a shared lock (Condition.notify_all would make every woken waiter re-acquire one)."""

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        abort: AbortSignal,
        timeout: float,
        *,
        group_ranks: Sequence[int] | None = None,
    ) -> None:
        """`ranks`: the members that meet here; `group_ranks`: the whole group's global ranks when some of
        its members live in other processes (messages name the group by them)."""
        self.name = name
        self.ranks = tuple(ranks)
        self.group_ranks = self.ranks if group_ranks is None else tuple(group_ranks)
        self.size = len(self.ranks)
        self._abort = abort
        self._timeout = timeout
        self._lock = threading.Lock()
        self._slots: dict[int, Slot] = {}
        abort.register_waker(self._wake_all)

    def arrive(
        self,
        member: int,
        seq: int,
        call: Call,
        payload: Any,
        *,
        leader: Callable[[Slot], bool] | None = None,
        final: bool = False,
        timeout: float | None = None,
    ) -> Slot:
        """Post this member's call and payload for collective `seq`; wait until every member has.

        The last member to arrive checks the calls match and then runs `leader(slot)` while the others
        wait; a leader that returns True has done the whole collective for everybody (`slot.finished`).
        `final` means this is the collective's only barrier. `timeout`: this wait's, instead of the group's
        (barrier(timeout=...)).
        """
        slot = self._deposit(member, seq, call, payload)
        self._barrier(slot, member, seq, leader, final, check=True, timeout=timeout)
        if slot.error is not None:
            self._raise(slot, seq)
        return slot

    def post(
        self,
        member: int,
        seq: int,
        call: Call,
        payload: Any,
        *,
        leader: Callable[[Slot], Any] | None = None,
        timeout: float | None = None,
    ) -> Arrival:
        """Post this member's call and payload for collective `seq` without waiting for the others.

        The last member to post checks the calls and runs `leader(slot)` (its only barrier); the others
        learn the outcome from `Arrival.wait()`, which raises what the leader raised (waiting at most
        `timeout`, else the group's).
        """
        slot = self._deposit(member, seq, call, payload)
        target, waiter = self._enter(slot, member, seq, leader, final=True, check=True, release_all=True)
        return Arrival(self, slot, member, seq, target, waiter, self._timeout if timeout is None else timeout)

    def sync(
        self, slot: Slot, member: int, seq: int, *, final: bool = False, timeout: float | None = None
    ) -> None:
        """Wait until every member of `slot` has reached this next barrier."""
        self._barrier(slot, member, seq, None, final, check=False, timeout=timeout)
        if slot.error is not None:
            self._raise(slot, seq)

    @contextlib.contextmanager
    def busy(self, slot: Slot, member: int) -> Iterator[None]:
        """Mark `member` as working for the group (in a wait bounded by its own timeout, which reports
        what it waited for): members waiting for it at a barrier wait for it rather than time out first
        and blame it."""
        with self._lock:
            slot.busy[member] = True
        try:
            yield
        finally:
            with self._lock:
                slot.busy[member] = False

    def arrived(self, seq: int) -> list[int]:
        """The global ranks of the members that have arrived at collective `seq` (its slot still open)."""
        with self._lock:
            slot = self._slots.get(seq)
            return [] if slot is None else [r for r, c in zip(self.ranks, slot.calls) if c is not None]

    # internals --------------------------------------------------------------------------------------------------
    def _deposit(self, member: int, seq: int, call: Call, payload: Any) -> Slot:
        """Put this member's call and payload into the slot of collective `seq` (created by the first)."""
        with self._lock:
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = Slot(self.size)
            slot.calls[member] = call
            slot.payloads[member] = payload
        return slot

    def _barrier(
        self, slot: Slot, member: int, seq: int, leader, final: bool, check: bool, timeout: float | None
    ) -> None:
        target, waiter = self._enter(slot, member, seq, leader, final, check, release_all=False)
        if waiter is not None:
            self._wait(slot, member, seq, target, waiter, self._timeout if timeout is None else timeout)
        if final or slot.finished or slot.error is not None:
            # Past the last barrier nobody reads this member's tensors: it lets go of its own payload itself.
            # Released by another thread, a payload made on this member's comm worker would be freed, on
            # free-threaded CPython, only when that worker next runs Python (biased reference counting: an
            # object is freed by the thread that made it; DESIGN.md rule 10), keeping the tensors alive.
            # (Each member writes only its own entries: single list-item stores.)
            slot.payloads[member] = None
            slot.shared[member] = None

    def _enter(self, slot: Slot, member: int, seq: int, leader, final: bool, check: bool, release_all: bool):
        """Reach the slot's next barrier; the last member runs the leader and releases the others.
        Returns (barrier number, this member's locked waiter, or None for the last member). `release_all`:
        at the last barrier the last member lets go of every member's payload (posting members may never
        wait: `post`); otherwise each member lets go of its own (`_barrier`)."""
        with self._lock:
            target = slot.phase + 1
            slot.reached[member] = target
            slot.arrived += 1
            last = slot.arrived == self.size
            if not last:
                waiter = _thread.allocate_lock()
                waiter.acquire()
                slot.waiters.append(waiter)
            else:
                if check:
                    slot.error = self._mismatch(slot, seq)
                if leader is not None and slot.error is None:
                    try:
                        slot.finished = bool(leader(slot))
                    except BaseException as error:
                        slot.error = error
                slot.arrived = 0
                slot.phase = target
                if final or slot.finished or slot.error is not None:
                    del self._slots[seq]
                    if release_all:
                        # Nobody reads the members' tensors after the last barrier: let go of them now, or
                        # every Arrival (an nccl Work's) would keep all members' payloads alive.
                        slot.payloads = [None] * self.size
                        slot.shared = [None] * self.size
                waiters, slot.waiters = slot.waiters, []
        if last:
            for w in waiters:
                w.release()
            return target, None
        return target, waiter

    def _wait(self, slot: Slot, member: int, seq: int, target: int, waiter, timeout: float) -> None:
        # Block on our own lock until the last arrival releases it; re-check the stop signal and the
        # deadline every poll interval (a stop also releases every waiter at once).
        # Once every member has arrived, the last one is running the leader, whose own waits are bounded
        # (e.g. asking other processes, with a message naming them): wait for it rather than time out first.
        # The same for members that are busy for the group (Rendezvous.busy) and have not arrived yet.
        deadline = time.monotonic() + timeout
        while slot.phase < target:
            self._abort.raise_if_set()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self._others_bounded(slot, target):
                    remaining = POLL_INTERVAL_S
                else:
                    raise CollectiveTimeoutError(self._describe_timeout(slot, member, seq, target, timeout))
            waiter.acquire(True, remaining if remaining < POLL_INTERVAL_S else POLL_INTERVAL_S)

    def _others_bounded(self, slot: Slot, target: int) -> bool:
        with self._lock:
            return all(r >= target or b for r, b in zip(slot.reached, slot.busy))

    def _wake_all(self) -> None:
        """On a stop: release every waiter (each then sees the stop signal and raises)."""
        with self._lock:
            for slot in self._slots.values():
                waiters, slot.waiters = slot.waiters, []
                for w in waiters:
                    w.release()

    def _mismatch(self, slot: Slot, seq: int) -> str | None:
        first = slot.calls[0]
        if all(c == first for c in slot.calls):
            return None
        members = [(f"rank {self.ranks[m]}", call, str(call)) for m, call in enumerate(slot.calls)]
        return "\n".join([mismatch.header(self.name, self.group_ranks, seq), *mismatch.member_lines(members)])

    def _raise(self, slot: Slot, seq: int) -> None:
        if isinstance(slot.error, str):
            raise CollectiveMismatchError(slot.error)
        call = slot.calls[0]
        if isinstance(slot.error, CollectiveTimeoutError):  # its message names the call and who is late
            raise CollectiveTimeoutError(str(slot.error)) from slot.error
        # An NCCL failure or a stop keeps its kind for every member; anything else is the group's failure.
        kind: type[ThreadparError]
        if isinstance(slot.error, RankAborted):
            kind = RankAborted  # (a subclass may not take a message)
        elif isinstance(slot.error, NcclError):
            kind = type(slot.error)
        else:
            kind = ThreadparError
        raise kind(
            f"{call} #{seq} on group '{self.name}' failed: {type(slot.error).__name__}: {slot.error}"
        ) from slot.error

    def _describe_timeout(self, slot: Slot, member: int, seq: int, target: int, timeout: float) -> str:
        missing = [self.ranks[m] for m in range(self.size) if slot.reached[m] < target]
        present = [self.ranks[m] for m in range(self.size) if slot.reached[m] >= target]
        stage = "did not arrive" if target == 1 else f"did not reach step {target} of the collective"
        calls = "; ".join(
            f"rank {self.ranks[m]} called {c}" for m, c in enumerate(slot.calls) if c is not None
        )
        return (
            f"{slot.calls[member]} #{seq} on group '{self.name}' (global ranks {list(self.group_ranks)}) timed out after "
            f"{timeout:g} s on rank {self.ranks[member]}: ranks {missing} {stage} (waiting: {present}; {calls}). "
            "A rank that skips a collective, calls them in another order, or is stuck in a long computation "
            "causes this; raise the timeout (the launch's timeout=, or this call's) if the computation is "
            "legitimately slow."
        )


class Arrival:
    """One member's posted call: `wait()` returns once every member has posted and the leader has run."""

    __slots__ = ("_member", "_rendezvous", "_seq", "_slot", "_target", "_timeout", "_waiter")

    def __init__(
        self, rendezvous: Rendezvous, slot: Slot, member: int, seq: int, target: int, waiter, timeout: float
    ) -> None:
        self._rendezvous, self._slot, self._member = rendezvous, slot, member
        self._seq, self._target, self._waiter, self._timeout = seq, target, waiter, timeout

    def done(self) -> bool:
        """True once the leader has run (successfully or not); never blocks."""
        return self._slot.phase >= self._target

    def error(self) -> BaseException | str | None:
        return self._slot.error if self.done() else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the leader has run (at most `timeout`, default the post's); raise what it raised."""
        if self._waiter is not None and not self.done():
            timeout = self._timeout if timeout is None else timeout
            self._rendezvous._wait(self._slot, self._member, self._seq, self._target, self._waiter, timeout)
        if self._slot.error is not None:
            self._rendezvous._raise(self._slot, self._seq)
