"""The `nccl` backend: every rank thread issues its own NCCL calls on its own communicator, as a process per
GPU does.

A member's collective is its own NCCL call on its own communicator (one per member and group), made from
its own thread in its program order: on the caller's current stream for a synchronous op (no events, as
vLLM's pynccl does), on the member's comm stream ordered by events for an asynchronous one (as torch's
ProcessGroupNCCL does). The call returns at once; the device waits for the peers' calls. No member waits
for another on the host, so a rank can run ahead of its peers by as many calls as it likes.

What the members still do together, each once: making the communicators (on a group's first NCCL
operation: they meet, then each creates its own on a connector, connector.py) and connecting NCCL's point
to point (the first operation that sends between members: scatter, gather, all_to_all). Collectives are
checked without a meeting (the CallLedger: each member compares its call with the first member's before
issuing it). The process's watchdog (watchdog.py) notices hangs and asynchronous errors and aborts the communicators when the launch stops.

A group whose members live in several processes (spanning.py) is this class over the members in THIS
process (`local`); NCCL ranks are group indices, so each process's calls are parts of one NCCL operation.
Operations are in ops.py (collectives), p2p.py (buffered, tagged send and receive) and exchange.py (sends
and receives of known shapes on the group's own communicator); dtypes and ops NCCL lacks are mapped as
reduction.py says. Inputs reach this module validated by ProcessGroup.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.backend import BackendSite
from threadpar.comm.common import graph_capture
from threadpar.comm.common.call_ledger import CallLedger
from threadpar.comm.common.rendezvous import Call, Rendezvous, Slot
from threadpar.comm.common.work import LazyText
from threadpar.comm.nccl.comm import NcclComm, ScaledSumIssue
from threadpar.comm.nccl.connector import connect
from threadpar.comm.nccl.exchange import NcclExchange
from threadpar.comm.nccl.ops import NcclCollectives, all_to_all_sizes
from threadpar.comm.nccl.p2p import NcclPointToPoint
from threadpar.comm.nccl.reduction import nccl_features
from threadpar.comm.nccl.resources import CliqueHealth
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import CollectiveTimeoutError, ConfigError, NcclError

# Issue = one member's NCCL calls of one operation, given its communicator's handle (and, for a
# ScaledSumIssue, the communicator's pre-multiplied sum: comm.py).
Issue = Callable[[Any], None] | ScaledSumIssue
# How long the watchdog waits for a device's launch lock before it leaves that device's communicators
# unaborted (a connector stuck in a blocking NCCL call holds it; aborting meanwhile is unsafe: comm.py).
ABORT_LOCK_WAIT_S = 5.0
# How long a tick waits for a device's launch lock before it leaves that device's look to the next tick: a rank
# in a long launch, or a connector in a blocking NCCL call that waits for a peer (for ever, if the peer's
# process died), holds it; the watchdog, shared by every group of the process, must not wait with them.
LOCK_WAIT_S = 0.01
# How long a member whose call differs waits for the other members' calls, so that its error names the
# minority whatever the arrival order (call_ledger.py); it never issues, so no peer waits for it meanwhile.
MISMATCH_WAIT_S = 2.0


class _Probe:
    """An event the watchdog recorded on a stream a member's NCCL calls went to: done once the device has
    run everything the member enqueued there before it."""

    __slots__ = ("event", "issued", "since", "stream")

    def __init__(self, event: Any, stream: Any, issued: int, since: float) -> None:
        self.event, self.stream, self.issued, self.since = event, stream, issued, since


class NcclGroup(NcclCollectives, NcclPointToPoint, NcclExchange):
    """The shared state of one group on the `nccl` backend; methods are called by each member."""

    stream_ordered = True  # ProcessGroup: ops return their own Work; no comm worker thread
    backend_name = "nccl"

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        world: BackendSite,
        local: Sequence[int] | None = None,
        key: int | None = None,
    ) -> None:
        """`local`: the indices of the members whose threads run in this process (default: all of them);
        `key`: the group's id, the same in every process (spanning groups)."""
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.devices = tuple(world.devices[r] for r in self.ranks)
        self.local = tuple(range(self.size)) if local is None else tuple(local)
        self.local_index = {m: i for i, m in enumerate(self.local)}
        self._device_ids = tuple(
            _device_id(d, r, world.local_ranks) for d, r in zip(self.devices, self.ranks)
        )
        self._runtime = world.nccl_runtime()
        if not self._runtime.nccl_available():
            raise ConfigError(
                f"backend='nccl' (group '{name}'): NCCL cannot run here (no CUDA device, or no NCCL library "
                f"loads; torch {torch.__version__}); install a CUDA build of torch, set THREADPAR_NCCL_LIBRARY "
                "to a libnccl.so.2, or use backend='threads'"
            )
        self._cuda = self._runtime.cuda
        self._nccl = self._runtime.nccl
        self._site = world
        self._abort = world.abort
        self._timeout = world.timeout
        local_ranks = [self.ranks[m] for m in self.local]
        # Calls matched in order without waiting (rule 6); meetings for creating and connecting only.
        self.ledger = CallLedger(
            name, local_ranks, self.ranks, wait_s=min(world.timeout, MISMATCH_WAIT_S), abort=world.abort
        )
        for op in ("all_to_all", "all_to_all_single"):  # (their sizes may differ between members)
            self.ledger.compare_with(op, all_to_all_sizes)
        self.meetings = Rendezvous(name, local_ranks, world.abort, world.timeout, group_ranks=self.ranks)
        self._lock = threading.Lock()  # guards the write-once slots below and the failure flag
        self._comms: list[NcclComm | None] = [None] * self.size
        self._streams: list[Any] = [None] * self.size  # each member's comm stream (asynchronous ops)
        # The pairs of members between which point-to-point is connected on the group's communicators, as
        # each member knows it (the same sequence of collectives gives every member the same set).
        self._connected: list[set[tuple[int, int]]] = [set() for _ in range(self.size)]
        self._probes: dict[int, deque[_Probe]] = {m: deque() for m in self.local}
        self._probed: dict[int, int] = dict.fromkeys(self.local, 0)  # operations issued at the last probe
        # The pool's key: the CUDA device of each member (the double's fake GPUs are all "cpu" devices).
        self._clique_key = tuple(str(d) for d in self._device_ids)
        self._features = nccl_features(self._nccl.version())
        self._health = CliqueHealth()  # spoiled by any failure: its clique is then never pooled
        self._failed = False  # the watchdog reported a failure of this group (once)
        self._closed = False
        self._init_p2p(world, key)
        self._runtime.prepare_environment()
        weakref.finalize(self, self._runtime.streams.release, self.devices, self._streams)
        self._runtime.watchdog.watch(self)
        world.abort.register_waker(self._runtime.watchdog.wake)  # a stop: the watchdog aborts (watch_tick)

    # the path of every operation --------------------------------------------------------------------------------
    def _op_stream(self, member: int, async_op: bool) -> Any:
        """Where a member's operation runs: its current stream (synchronous), or its comm stream after the
        work enqueued so far on the current one (asynchronous)."""
        current = self._cuda.current_stream(self.devices[member])
        if not async_op:
            return current
        stream = self._streams[member]
        if stream is None:
            with self._lock:  # (one no other live group holds: CommStreams)
                if self._streams[member] is None:
                    self._streams[member] = self._runtime.streams.acquire(self._cuda, self.devices[member])
                stream = self._streams[member]
        ready = self._cuda.event()
        ready.record(current)
        stream.wait_event(ready)
        return stream

    def _on(self, stream: Any, async_op: bool) -> contextlib.AbstractContextManager[Any]:
        """Make `stream` current for torch ops (nothing to do for a synchronous op: it is current)."""
        return self._cuda.on_streams(stream) if async_op else contextlib.nullcontext()

    def _issue(
        self,
        member: int,
        seq: int,
        call: Call,
        stream: Any,
        issue: Issue,
        pairs: frozenset[tuple[int, int]] = frozenset(),
        checked: Call | None = None,
    ) -> None:
        """Check call #seq against the other members' (without waiting) and issue it on the member's
        communicator. The group's first NCCL operation makes the communicators; one that sends between
        members not yet connected (`pairs`) connects them: both after a meeting, on a connector. `checked`:
        what the ledger compares, when it says more than the call (all_to_all's sizes, which may differ)."""
        checked = call if checked is None else checked
        comm = self._comms[member]
        try:
            if comm is None or not pairs <= self._connected[member]:
                graph_capture.refuse(
                    f"{call}, the first NCCL operation of group '{self.name}' that {'makes' if comm is None else 'connects'}"
                    " its communicators",
                    "that takes a meeting of the group's members, which a graph cannot hold and the captures (one "
                    "rank at a time) would deadlock; run the step eagerly first (graphed_step's warmup_steps) so "
                    "that every group it uses has issued this kind of operation before the capture",
                )
            if comm is None:
                self._create(member, seq, call, checked, stream, issue)
            elif not pairs <= self._connected[member]:
                self._enter(member, seq, checked)
                self._connect(member, seq, call, stream, issue)
            else:
                self._enter(member, seq, checked)
                comm.launch(issue, stream)
        except NcclError as error:
            self._health.spoil(f"{call} #{seq}: {error}")
            raise NcclError(
                f"{call} #{seq} on group '{self.name}' (rank {self.ranks[member]}) failed: {error}"
            ) from error
        self._connected[member] |= pairs

    def _enter(self, member: int, seq: int, call: Call) -> None:
        """The ledger's check (spanning.py adds the processes')."""
        self.ledger.enter(self.local_index[member], seq, call)

    def _finish(
        self,
        member: int,
        seq: int,
        call: Call,
        stream: Any,
        tensors: Sequence[torch.Tensor],
        async_op: bool,
        *,
        blocking: bool = False,
    ) -> NcclWork | None:
        """A synchronous op is done (its stream orders what follows); an asynchronous one gets a Work on a
        done event, and its tensors are kept from the caching allocator until its stream is past them."""
        if not async_op:
            return None
        done = self._cuda.event()
        done.record(stream)
        for t in tensors:
            self._cuda.record_stream(t, stream)
        return self._work(member, seq, call, done, blocking=blocking)

    def _work(self, member: int, seq: int, call: Call, done: Any, *, blocking: bool = False) -> NcclWork:
        return NcclWork(
            LazyText("{} #{} on group '{}' (rank {})", call, seq, self.name, self.ranks[member]),
            cuda=self._cuda,
            device=self.devices[member],
            abort=self._abort,
            timeout=self._timeout,
            done=done,
            comm=self._comms[member],
            health=self._health,
            blocking=blocking,
            late=lambda: self._late(seq),
        )

    def _late(self, seq: int) -> str:
        """Who has not issued call #seq yet (in this process), for a timeout's message."""
        missing = self.ledger.missing(seq)
        return f"ranks {missing} did not arrive (they have not issued it)" if missing else ""

    def _check_devices(self, member: int, op: str, tensors: Sequence[torch.Tensor]) -> None:
        device = self.devices[member]
        for t in tensors:
            if t.device != device:
                raise ConfigError(
                    f"{op} on group '{self.name}': rank {self.ranks[member]} runs on {device} but passed a tensor "
                    f"on {t.device}; move it with tensor.to(threadpar.get_device())"
                )

    # making and connecting the communicators --------------------------------------------------------------------
    def _meet(self, member: int, seq: int, call: Call, leader: Callable[[Slot], bool] | None = None) -> Slot:
        """Every member (in this process) arrives before any enters a blocking NCCL call; spanning.py also
        asks the other processes."""
        return self.meetings.arrive(self.local_index[member], seq, call, None, leader=leader, final=True)

    def _choose_clique(self, slot: Slot) -> bool:
        """The meeting's leader: a clique a finished launch left on these devices, or a new unique id."""
        slot.result = self._runtime.cliques.take(self._clique_key) or self._nccl.get_unique_id()
        return False

    def _unique_id(self, member: int, slot: Slot) -> bytes:
        return slot.result

    def _create(self, member: int, seq: int, call: Call, checked: Call, stream: Any, issue: Issue) -> None:
        """The members meet; each makes its communicator (ncclCommInitRank blocks until all have joined)
        and issues its first operation on it, on a connector (the first use of an algorithm may connect
        peers, blocking too)."""
        joining = call._replace(extra=(*call.extra, ("creating", "NCCL communicators")))
        slot = self._meet(member, seq, joining, self._choose_clique)
        self._enter(member, seq, checked)
        label = f"rank {self.ranks[member]} in group '{self.name}'"
        if isinstance(slot.result, list):  # a pooled clique: made and connected already
            comm: NcclComm = slot.result[member]
            comm.label = label
            comm.launch(issue, stream)
        else:
            comm = self._make_comm(member, seq, call, self._unique_id(member, slot), stream, issue, label)
        with self._lock:
            self._comms[member] = comm

    def _make_comm(
        self, member: int, seq: int, call: Call, uid: bytes, stream: Any, issue: Issue, label: str
    ) -> NcclComm:
        nccl, device = self._nccl, self._device_ids[member]
        lock = self._runtime.device_locks.lock(device)

        def create() -> NcclComm:
            with lock:
                try:
                    raw = nccl.comm_init_rank(self.size, uid, member, device)
                except NcclError as error:
                    raise NcclError(
                        f"creating the NCCL communicator of {label} (devices {list(self._clique_key)}) failed: "
                        f"{error}"
                    ) from error
                comm = NcclComm(raw, nccl, device, lock, label)
                comm.launch_locked(issue, (stream,))
            return comm

        return connect(
            label,
            create,
            abort=self._abort,
            timeout=self._timeout,
            describe_timeout=lambda: self._creation_timeout(member, seq, call),
            undo=_abort_given_up,
        )

    def _connect(self, member: int, seq: int, call: Call, stream: Any, issue: Issue) -> None:
        """The first operation that sends between some members on the group's communicators: NCCL connects
        them inside it, blocking until the peers do the same (point-to-point connections are made on first
        use, whatever NCCL_RUNTIME_CONNECT says: src/transport.cc)."""
        connecting = call._replace(extra=(*call.extra, ("connecting", "NCCL point-to-point")))
        self._meet(member, seq, connecting)
        comm = self._comms[member]
        assert comm is not None  # (made by the group's first operation)
        connect(
            comm.label,
            lambda: comm.launch(issue, stream),
            abort=self._abort,
            timeout=self._timeout,
            describe_timeout=lambda: self._creation_timeout(member, seq, call),
        )

    def _creation_timeout(self, member: int, seq: int, call: Call) -> str:
        return (
            f"{call} #{seq} on group '{self.name}' (global ranks {list(self.ranks)}): rank {self.ranks[member]} "
            f"waited {self._timeout:g} s inside NCCL for its peers to create or connect their communicators, after "
            "all of them had arrived; a peer process may have died (NCCL_DEBUG=INFO shows what NCCL waits for)"
        )

    # the watchdog -----------------------------------------------------------------------------------------------
    def watch_tick(self, now: float) -> None:
        """Run by the process's watchdog every interval (watchdog.py)."""
        if self._abort.is_set:
            self._abort_communicators(self._abort.reason or "the launch stopped")
            self._runtime.watchdog.unwatch(self)
            return
        if self._failed or self._closed:
            return
        try:
            self._watch_errors()
            self._watch_late(now)
            self._watch_device(now)
        except Exception as error:  # a query that failed: a failure of the group too
            self._fail(self.local[0], NcclError(f"the NCCL watchdog of group '{self.name}' failed: {error}"))

    def _watch_errors(self) -> None:
        for member in self.local:
            comm = self._comms[member]
            message = None if comm is None else comm.async_error(LOCK_WAIT_S)
            if message is not None:
                self._fail(
                    member,
                    NcclError(
                        f"NCCL reported an asynchronous error on the communicator of rank {self.ranks[member]} in "
                        f"group '{self.name}': {message}"
                    ),
                )
                return

    def _watch_late(self, now: float) -> None:
        """A call some members issued more than the timeout ago that others have not: name them."""
        late = self.ledger.overdue(self._timeout, now)
        if not late:
            return
        first = late[0]
        waiting = self.local[self.ledger.ranks.index(first.issued[0])]
        self._fail(
            waiting,
            CollectiveTimeoutError(
                f"{first.call} #{first.seq} on group '{self.name}' (global ranks {list(self.ranks)}) timed out "
                f"after {self._timeout:g} s: ranks {first.missing} did not issue it (issued by {first.issued}). "
                "A rank that skips a collective, calls them in another order, or is stuck in a long computation "
                "causes this; raise the timeout (the launch's timeout=) if the computation is legitimately slow."
            ),
        )

    def _watch_device(self, now: float) -> None:
        """Probe events after each member's NCCL calls: one still pending after the timeout means the device
        has not finished those calls (a peer's part never ran: a peer process lost, a peer's stream stuck
        behind another group's kernel in another order, a hung kernel)."""
        for member in self.local:
            comm, probes = self._comms[member], self._probes[member]
            if comm is None:
                continue
            while probes and probes[0].event.query():
                probes.popleft()
            if probes and now - probes[0].since > self._timeout and not self._device_wait_explained():
                probe = probes[0]
                self._fail(
                    member,
                    CollectiveTimeoutError(
                        f"the device has not finished the NCCL operations rank {self.ranks[member]} issued on group "
                        f"'{self.name}' (its first {probe.issued} of them, or what its streams ran after them, such as "
                        f"a graphed step's replays) within {self._timeout:g} s: a peer's "
                        "matching call never ran (a peer process lost, its stream stuck behind work that waits for "
                        "this one, operations of several groups ordered differently on two ranks), or a kernel "
                        "hangs (NCCL_DEBUG=INFO says which)"
                    ),
                )
                return
            progress = comm.take_progress(LOCK_WAIT_S)
            if progress is None:  # (the device is busy: the next tick looks again)
                continue
            issued, streams = progress
            if issued > self._probed[member]:
                self._probed[member] = issued
                for stream in streams:
                    event = self._cuda.event()
                    event.record(stream)
                    probes.append(_Probe(event, stream, issued, now))

    def _device_wait_explained(self) -> bool:
        """Whether a check that names why the device waits is under way: it reports instead (spanning.py)."""
        return False

    def _fail(self, member: int, error: BaseException) -> None:
        """Report `error` as this member's failure (once per group): the launch stops, and the next tick
        aborts the communicators."""
        with self._lock:
            if self._failed:
                return
            self._failed = True
        self._health.spoil(f"{type(error).__name__}: {error}")
        self._site.fail(self.ranks[member], error)

    # the end ------------------------------------------------------------------------------------------------------
    def _communicators(self) -> list[NcclComm]:
        with self._lock:
            return [c for c in self._comms if c is not None] + self._pair_communicators()

    def _abort_communicators(self, reason: str) -> None:
        """ncclCommAbort every communicator of this group in this process: kernels waiting for peers that
        will never come end, and every rank waiting on the device is released (nccl.h)."""
        self._health.spoil(f"the launch stopped: {reason}")
        self._site.release_graphs(wait=False)  # (NCCL frees no communicator a live graph captured)
        for comm in self._communicators():
            comm.abort(reason, ABORT_LOCK_WAIT_S)

    def close(self, failed: bool) -> None:
        """The end of the launch (World.close, after every rank thread has finished): give a clean clique
        back to the pool or destroy it; abort what a failed or stopped launch leaves."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._runtime.watchdog.unwatch(self)
        comms = self._communicators()
        try:
            unfinished = None if failed or self._abort.is_set else self._unfinished(comms)
            if failed or self._abort.is_set or self._health.spoiled or unfinished is not None:
                for comm in comms:
                    comm.abort("the launch failed", ABORT_LOCK_WAIT_S)
            else:
                for comm in self._keep(comms):
                    comm.destroy()
        finally:
            self._runtime.streams.release(self.devices, self._streams)
            self._end_p2p()
        if unfinished is not None:
            raise CollectiveTimeoutError(unfinished)

    def _unfinished(self, comms: list[NcclComm]) -> str | None:
        """After every rank thread has finished: wait (at most the timeout) until the device has run every
        NCCL operation issued on these communicators (ncclCommDestroy would wait for them for ever: a peer
        may never have issued its part); what it has not run, if anything."""
        probes = [p for member in self.local for p in self._probes[member]]
        for comm in comms:
            issued, streams = comm.take_progress()  # type: ignore[misc]  # (no bound: never None)
            for stream in streams:
                event = self._cuda.event()
                event.record(stream)
                probes.append(_Probe(event, stream, issued, 0.0))
        deadline = time.monotonic() + self._timeout
        while not all(p.event.query() for p in probes):
            if time.monotonic() > deadline:
                late = self.ledger.overdue(0.0)
                who = (
                    f": ranks {late[0].missing} never issued {late[0].call} #{late[0].seq} (issued by {late[0].issued})"
                    if late
                    else " (a send no rank received, or a peer in another process that never issued its part)"
                )
                return (
                    f"the launch ended, but the device had not finished the NCCL operations of group '{self.name}' "
                    f"within {self._timeout:g} s{who}; its communicators were aborted"
                )
            time.sleep(0.001)
        return None

    def _keep(self, comms: list[NcclComm]) -> list[NcclComm]:
        """Pool the group's clique (if every member of it is here and made its communicator); returns what is
        left to destroy (spanning.py pools nothing)."""
        clique = [c for c in self._comms if c is not None]
        if len(clique) != self.size or not clique:
            return comms
        rest = [c for c in comms if all(c is not k for k in clique)]
        return self._runtime.cliques.put(self._clique_key, clique) + rest

    def __repr__(self) -> str:
        return f"<NcclGroup '{self.name}' ranks={list(self.ranks)} local={list(self.local)}>"


def _abort_given_up(comm: NcclComm) -> None:
    """A communicator whose creation finished after its member gave up waiting for it (connector.py)."""
    comm.abort("its creation was given up")


def _device_id(device: torch.device, rank: int, local_ranks: range) -> int:
    """The CUDA device index NCCL binds a member's communicator to. CPU devices carry none: a world on CPU
    devices (the test double's, tests/fakes) numbers its rank threads' devices by their place in this
    process, as its fake GPUs are numbered; -1 for a member in another process (never initialised here)."""
    if device.index is not None:
        return device.index
    return local_ranks.index(rank) if rank in local_ranks else -1
