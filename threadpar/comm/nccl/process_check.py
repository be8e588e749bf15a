"""Do the processes of a group agree on an NCCL call? Asked through the launch's store, not through NCCL.

NCCL itself never checks: processes that call different collectives (or the same with other sizes) hang
or corrupt data, and a process that never comes leaves the others' kernels waiting for ever. The
hierarchical backend checks every call with a gloo round trip (call_check.py); for an NCCL collective that
round trip would cost more than the collective, so the nccl backend asks only (spanning.py):
- on a group's first NCCL collective, before anybody enters NCCL's initialisation (which has no timeout);
- on every NCCL collective with LaunchConfig.check_collectives (or THREADPAR_CHECK_COLLECTIVES=1): a
  debugging aid, like TORCH_DISTRIBUTED_DEBUG.

One thread per process (the local leader of a meeting, or the member that completed the local check of a
call) writes "#seq call" under a key of its own, named by what is checked and its sequence number (the same
in every process, whichever order the checks of different calls run in), and waits for every other
process's key. A process that does not come within the timeout is named with its ranks; calls that differ
are shown side by side, like the other mismatch messages. One check at a time per group (`_lock`): the
waits are short, and it is a debugging aid where it runs per call.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from typing import Any

from threadpar.comm.common import mismatch
from threadpar.comm.common.abort import AbortSignal
from threadpar.errors import CollectiveTimeoutError

# How often a waiting leader looks at the stop signal.
POLL = datetime.timedelta(milliseconds=100)


class ProcessCheck:
    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        procs: Sequence[int],
        ranks_by_proc: Sequence[Sequence[int]],
        me: int,
        processes: Any,
        group_key: str,
        abort: AbortSignal,
        timeout: float,
    ) -> None:
        """`procs`: the group's processes (sorted), `ranks_by_proc`: the global ranks each holds, `me`:
        this process's index in `procs`, `processes`: the launch's Processes (for a store client)."""
        self.name, self.ranks = name, tuple(ranks)
        self.procs, self.ranks_by_proc, self.me = tuple(procs), ranks_by_proc, me
        self._processes = processes
        self._prefix = f"check/{group_key}"
        self._abort, self._timeout = abort, timeout
        self._store: Any = None  # one client, made on first use
        self._lock = threading.Lock()  # one check at a time (guards _store too)
        # Set while a check waits for the other processes, and left set when one fails (the rank that ran it
        # raises): the group's NCCL watchdog reads it (explains_device_waits) from its own thread.
        self._explaining = threading.Event()

    def explains_device_waits(self) -> bool:
        """Whether a check is under way or has failed: then a device that waits on this group's NCCL calls may
        wait for a process that has not made the call, and the check will say which, naming it, within the
        same timeout; the device watchdog's own message could only say that the device waits."""
        return self._explaining.is_set()

    def agree(self, seq: int, call: object, what: str = "call") -> str | None:
        """None if every process of the group describes `what` #seq (a call, or a meeting) the same way, else
        a mismatch message. Raises CollectiveTimeoutError naming the processes that did not come."""
        with self._lock:
            self._explaining.set()
            outcome = self._agree(seq, call, what)  # (raising: left set, the caller reports why)
            if outcome is None:
                self._explaining.clear()
            return outcome

    def _agree(self, seq: int, call: object, what: str) -> str | None:
        if self._store is None:
            self._store = self._processes.store_client()
        store = self._store
        keys = [f"{self._prefix}/{what}{seq}/{p}" for p in self.procs]
        store.set(keys[self.me], f"#{seq} {call}")
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                store.wait(keys, POLL)
                break
            except RuntimeError:  # DistStoreError: not all there yet
                self._abort.raise_if_set()
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(self._describe_missing(store, keys, seq, call)) from None
        texts = [store.get(k).decode(errors="replace") for k in keys]
        if all(t == texts[self.me] for t in texts):
            return None
        members = [(f"process {p}", text, text) for p, text in zip(self.procs, texts)]
        return "\n".join(
            [
                mismatch.header(self.name, self.ranks, seq, " across processes"),
                *mismatch.member_lines(members),
            ]
        )

    def _describe_missing(self, store: Any, keys: list[str], seq: int, call: object) -> str:
        missing = [i for i, key in enumerate(keys) if not store.check([key])]
        who = ", ".join(f"process {self.procs[i]} (ranks {list(self.ranks_by_proc[i])})" for i in missing)
        return (
            f"{call} #{seq} on group '{self.name}' (global ranks {list(self.ranks)}) timed out after "
            f"{self._timeout:g} s in process {self.procs[self.me]}: {who} did not reach it. A process that "
            "skips the collective, calls another one first, or is stuck or dead causes this (NCCL calls are "
            "checked between processes on a group's first call, or on every call with launch(..., "
            "check_collectives=True) or THREADPAR_CHECK_COLLECTIVES=1)."
        )
