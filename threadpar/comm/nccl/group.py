"""The `nccl` backend: one thread launches each collective for all members, on their comm streams.

NCCL is reached through its C API (library.py; torch.cuda.nccl cannot create communicators on CPython
3.10-3.12). NCCL calls are not thread-safe across communicators that share a device, so rank threads never
call NCCL themselves. A member that calls a collective records a *ready* event on its current stream and posts its
tensors at the group's rendezvous (without waiting). The last member to post, the leader, then under the
process-wide launch lock makes each member's comm stream wait for that member's ready event, issues ONE
NCCL group (ncclGroupStart, one operation per member with its tensor, comm stream and communicator, in
group-rank order, ncclGroupEnd), and records each member's *done* event on its comm stream. Each member gets an `NcclWork` on its done event.

Communicators: one clique per group (sub-groups get their own), made on the group's first collective by
every member thread calling ncclCommInitRank concurrently on its own device, as nccl.h allows (the
ncclCommInitAll of one process, without one thread setting every device), then reused. Comm streams: one per member and group, never shared with another live group
(resources.CommStreams: torch's pool would hand the same stream to every 32nd group).

A group whose members live in several processes (spanning.py) is this class with `local` = the
members in this process: its rendezvous, launch and grouped calls cover those members only (NCCL ranks are
group indices, so one grouped call per process joins the processes' parts into one collective).

Every collective is NCCL's own (broadcast and reduce from any root, all_gather and reduce_scatter at their
own bytes, also across processes). Within one process send/recv, scatter, gather and all_to_all are copies
between devices on the comm streams, ordered by events (copies.py): one copy engine transfer each. dtypes and ops NCCL lacks are mapped as
reduction.py describes. Inputs reach this module validated by ProcessGroup.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from threadpar.comm.backend import BackendSite
from threadpar.comm.common.mailbox import Mailboxes
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_
from threadpar.comm.common.rendezvous import Call, Rendezvous, Slot
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.common.work import LazyText
from threadpar.comm.nccl.copies import NcclCopyCollectives
from threadpar.comm.nccl.library import nccl_group
from threadpar.comm.nccl.reduction import (
    NcclReduction,
    contiguous_span,
    flat,
    has_native_avg,
    nccl_reduction,
    wire,
)
from threadpar.comm.nccl.resources import CliqueHealth
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import ConfigError, NcclError

# Launch = what the leader enqueues: f(payloads in group-rank order, comm streams in group-rank order).
Launch = Callable[[list[Any], list[Any]], None]
# Issue = one local member's NCCL operation: f(local position, its communicator, its comm stream).
Issue = Callable[[int, Any, Any], None]


class _Posted(NamedTuple):
    payload: Any  # the member's tensors, as its op passes them
    tensors: tuple[torch.Tensor, ...]  # all of them, to protect from the caching allocator
    ready: Any  # recorded on the member's current stream when it called
    done: Any  # recorded by the leader on the member's comm stream after the operation


def _tensors(payload: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(payload, torch.Tensor):
        return (payload,)
    if type(payload) is list and all(type(t) is torch.Tensor for t in payload):
        return tuple(payload)  # an all-reduce's tensors: the common case, without the recursion
    if isinstance(payload, (list, tuple)):
        return tuple(t for part in payload for t in _tensors(part))
    return ()


class NcclGroup(NcclCopyCollectives):
    """The shared state of one group on the `nccl` backend; methods are called by each member."""

    stream_ordered = True  # ProcessGroup: ops return their own Work; no comm worker thread
    backend_name = "nccl"

    def __init__(
        self, name: str, ranks: Sequence[int], world: BackendSite, local: Sequence[int] | None = None
    ) -> None:
        """`local`: the indices of the members whose threads run in this process (default: all of them)."""
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.devices = tuple(world.devices[r] for r in self.ranks)
        self.local = tuple(range(self.size)) if local is None else tuple(local)
        self.local_index = {m: i for i, m in enumerate(self.local)}
        self.local_devices = tuple(self.devices[m] for m in self.local)
        self._device_ids = tuple(
            _device_id(d, r, world.local_ranks) for d, r in zip(self.devices, self.ranks)
        )
        self._runtime = world.nccl_runtime()
        self._cuda = self._runtime.cuda
        if not self._runtime.nccl_available():
            raise ConfigError(
                f"backend='nccl' (group '{name}'): NCCL cannot run here (no CUDA device, or no NCCL library "
                f"loads; torch {torch.__version__}); install a CUDA build of torch, set THREADPAR_NCCL_LIBRARY "
                "to a libnccl.so.2, or use backend='threads'"
            )
        self._abort = world.abort
        self._timeout = world.timeout
        self.rendezvous = Rendezvous(name, [self.ranks[m] for m in self.local], world.abort, world.timeout)
        self.mailboxes = Mailboxes(name, ranks, world.abort, world.timeout)
        self._lock = threading.Lock()
        self._streams: list[Any] = [None] * self.size
        self._comms: list[Any] = [None] * self.size
        # The leaders' caches of the two lists above in local order (made once: _make_local_streams, _nccl).
        self._local_streams: list[Any] | None = None
        self._local_comms: list[Any] | None = None
        self._clique_key = tuple(str(d) for d in self.devices)
        self._native_avg = has_native_avg(self._runtime.nccl.version())
        self._aborted = False  # set once the launch stopped and this group's communicators were aborted
        world.abort.register_waker(_weak_call(self._abort_communicators))  # (weak: the abort outlives groups)
        weakref.finalize(self, self._runtime.streams.release, self.devices, self._streams)
        # Spoiled by any failure of this group's operations: its clique is then never pooled.
        self._health = CliqueHealth()

    # setup ------------------------------------------------------------------------------------------------------
    def _make_local_streams(self) -> list[Any]:
        """The local members' comm streams in order, kept for the launches after the first. Leaders of two
        collectives may both make it at first: each builds the same list (`_stream` makes each stream once,
        under `_lock`), so either write is right (a write-once value: DESIGN.md rule 10's allowed case)."""
        streams = [self._stream(m) for m in self.local]
        self._local_streams = streams
        return streams

    def _stream(self, member: int) -> Any:
        stream = self._streams[member]
        if stream is None:
            with self._lock:
                if self._streams[member] is None:  # (one no other live group holds: CommStreams)
                    self._streams[member] = self._runtime.streams.acquire(self._cuda, self.devices[member])
                stream = self._streams[member]
        return stream

    def _communicator(self, member: int, seq: int, call: Call) -> Any:
        """This member's communicator; on first use every member joins the group's clique (blocking)."""
        comm = self._comms[member]
        if comm is not None:
            return comm
        runtime = self._runtime

        def choose(slot: Slot) -> bool:
            # A clique a finished launch left on these devices, or a fresh unique id for a new one. The
            # clique goes back to the pool when this group is dropped (the members fill self._comms).
            slot.result = runtime.cliques.take(self._clique_key) or runtime.nccl.get_unique_id()
            weakref.finalize(
                self, runtime.cliques.give_back, self._clique_key, self._comms, self._health, self._abort
            )
            return False

        # Sequence number 0 is never a collective's (ProcessGroup counts from 1): the members meet there
        # once, with the call that needs the communicators (so a mismatch shows already), so that all of
        # them are present before any blocks inside NCCL's own initialisation, which has no timeout.
        joining = call._replace(extra=(*call.extra, ("creating", "NCCL communicators")))
        slot = self.rendezvous.arrive(self.local_index[member], 0, joining, None, leader=choose, final=True)
        if isinstance(slot.result, bytes):
            try:
                with self._initialising(member):
                    comm = runtime.nccl.comm_init_rank(
                        self.size, slot.result, member, self._device_ids[member]
                    )
            except RuntimeError as error:
                raise NcclError(
                    f"creating the NCCL communicator of rank {self.ranks[member]} in group '{self.name}' "
                    f"(devices {list(self._clique_key)}) failed: {error}"
                ) from error
        else:
            comm = slot.result[member]
        self._comms[member] = comm
        return comm

    @contextlib.contextmanager
    def _initialising(self, member: int) -> Iterator[None]:
        """Around this member's ncclCommInitRank: its device is marked (taken under the launch lock, so that
        no launch is issuing then), and launches on it wait until the init returns (DeviceInits)."""
        runtime, device = self._runtime, self.devices[member]
        with runtime.launch_lock:
            runtime.inits.enter(device)
        try:
            with self._cuda.device_guard(device):
                yield
        finally:
            runtime.inits.leave(device)

    def _check_devices(self, member: int, op: str, tensors: Sequence[torch.Tensor]) -> None:
        device = self.devices[member]
        for t in tensors:
            if t.device != device:
                raise ConfigError(
                    f"{op} on group '{self.name}': rank {self.ranks[member]} runs on {device} but passed a tensor "
                    f"on {t.device}; move it with tensor.to(threadpar.get_device())"
                )

    # the common path --------------------------------------------------------------------------------------------
    def _post(
        self, member: int, seq: int, call: Call, payload: Any, launch: Launch, *, nccl: bool = True
    ) -> NcclWork:
        """Record this member's ready event, post its tensors, and return its Work; the last member to
        post launches the operation for all (`nccl`: it needs the communicators)."""
        tensors = _tensors(payload)
        self._check_devices(member, call.op, tensors)
        comm = self._communicator(member, seq, call) if nccl else None
        cuda, device = self._cuda, self.devices[member]
        ready, done = cuda.event(), cuda.event()
        ready.record(cuda.current_stream(device))
        arrival = self.rendezvous.post(
            self.local_index[member],
            seq,
            call,
            _Posted(payload, tensors, ready, done),
            leader=lambda slot: self._launch(slot, seq, launch),
        )
        return self._work(member, seq, call, arrival=arrival, done=done, comm=comm)

    def _work(self, member: int, seq: int, call: Call, **state: Any) -> NcclWork:
        """The Work of `member`'s call; `state`: what it waits for (arrival, done event, communicator)."""
        return NcclWork(
            LazyText("{} #{} on group '{}' (rank {})", call, seq, self.name, self.ranks[member]),
            runtime=self._runtime,
            device=self.devices[member],
            abort=self._abort,
            timeout=self._timeout,
            health=self._health,
            **state,
        )

    def _before_launch(self, seq: int, call: Call) -> str | None:
        """Run by the leader before it launches collective `seq`; a message stops the launch as a mismatch
        (spanning.py asks the other processes here)."""
        return None

    def _launch(self, slot: Slot, seq: int, launch: Launch) -> bool:
        """The leader: payloads and streams of the local members, in group order."""
        call = slot.calls[0]
        assert call is not None  # the leader runs once every member has posted its call
        slot.error = self._before_launch(seq, call)
        if slot.error is not None:
            return False
        posted: list[_Posted] = slot.payloads
        streams = self._local_streams or self._make_local_streams()
        cuda, runtime = self._cuda, self._runtime
        while True:
            with runtime.launch_lock:
                if not runtime.inits.busy(self.local_devices):
                    for p, stream in zip(posted, streams):
                        stream.wait_event(p.ready)
                    launch([p.payload for p in posted], streams)
                    for p, stream in zip(posted, streams):
                        p.done.record(stream)
                        for t in p.tensors:
                            cuda.record_stream(t, stream)
                    return True
            # a communicator of another group is being created on one of these devices: wait, unlocked
            runtime.inits.wait_idle(self.local_devices, self._abort, self._timeout)

    def _nccl(self, name: str, streams: Sequence[Any], issue: Issue) -> None:
        """One NCCL group holding `issue(i, comm, stream)` for every local member i, in group order (NCCL
        ranks are group indices); failures become NcclError naming the group."""
        comms = self._local_comms
        if comms is None:  # (every member has its communicator by its first launch; made once)
            comms = self._local_comms = [self._comms[m] for m in self.local]
        try:
            with nccl_group(self._runtime.nccl):
                for i, (comm, stream) in enumerate(zip(comms, streams)):
                    issue(i, comm, stream)
        except NcclError as error:
            raise NcclError(f"NCCL {name} on group '{self.name}' failed: {error}") from error

    def _abort_communicators(self) -> None:
        """The launch stopped (a rank failed, a timeout, Ctrl-C): ncclCommAbort this group's communicators
        in this process, so that a kernel waiting for a peer that will never come ends (nccl.h: abort
        ends uncompleted operations). Not under the launch lock: the stop may come from a thread that holds
        it, and aborting from another thread while an operation hangs is what ncclCommAbort is for. An
        aborted communicator is freed: the group's list drops it (never pooled, never used again)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            comms = [c for c in self._comms if c is not None]
            self._comms[:] = [None] * self.size
        for comm in comms:
            with contextlib.suppress(Exception):  # (stopping anyway: the cause is already recorded)
                self._runtime.nccl.comm_abort(comm)

    def _on(self, stream: Any):
        return self._cuda.on_streams(stream)

    def _contiguous(self, t: torch.Tensor, stream: Any) -> torch.Tensor:
        if t.is_contiguous():
            return t
        with self._on(stream):
            return t.contiguous()

    # reductions -------------------------------------------------------------------------------------------------
    # ins, outs and streams hold one entry per LOCAL member (self.local order); `root` is a group index.
    def _reduce(
        self, ins: list[torch.Tensor], outs: list[torch.Tensor], op: ReduceOp, streams, kind: str, root=0
    ):
        """The reduction core. kind "all": outs[i] = reduce(ins); "root": the root's out = reduce(ins);
        "scatter": outs[i] = reduce(ins)[member's 1/size]. Every tensor is contiguous and 1-D."""
        how = nccl_reduction(ins[0].dtype, op, self._native_avg, self.size)
        if ins[0].numel() == 0:
            return
        if how.gather:
            self._gather_reduce(ins, outs, op, streams, kind, root)
            return
        wins, wouts = [wire(t, how) for t in ins], [wire(t, how) for t in outs]
        if kind == "all":
            nccl, op_ = self._runtime.nccl, how.nccl_op
            self._nccl("all_reduce", streams, lambda i, c, s: nccl.all_reduce(wins[i], wouts[i], op_, c, s))
        elif kind == "root":
            self._nccl_reduce(wins, wouts, root, how, streams)
        else:
            self._nccl_reduce_scatter(wins, wouts, how, streams)
        if how.divide:  # AVG as SUM: divide the receivers' outputs
            self._divide(outs, streams, self._receivers(kind, root))

    def _receivers(self, kind: str, root: int) -> Sequence[int]:
        """The local positions whose outputs a reduction of `kind` writes."""
        if kind != "root":
            return range(len(self.local))
        return [self.local_index[root]] if root in self.local_index else []

    def _nccl_reduce(self, wins, wouts, root: int, how: NcclReduction, streams) -> None:
        """ncclReduce to NCCL rank `root` (a group index); the others pass no output (NCCL reads none)."""
        nccl, op, local = self._runtime.nccl, how.nccl_op, self.local

        def issue(i: int, comm: Any, stream: Any) -> None:
            nccl.reduce(wins[i], wouts[i] if local[i] == root else None, root, op, comm, stream)

        self._nccl("reduce", streams, issue)

    def _nccl_reduce_scatter(self, wins, wouts, how: NcclReduction, streams) -> None:
        """wins[i]: [size * count], wouts[i]: [count] (ncclReduceScatter's recvcount)."""
        nccl, op = self._runtime.nccl, how.nccl_op
        self._nccl(
            "reduce_scatter", streams, lambda i, c, s: nccl.reduce_scatter(wins[i], wouts[i], op, c, s)
        )

    def _all_gather_bytes(self, ins: list[torch.Tensor], outs: list[torch.Tensor], streams) -> None:
        """outs[i] ([size * n] uint8) = every member's ins ([n] uint8), in group order (ncclAllGather)."""
        nccl = self._runtime.nccl
        self._nccl("all_gather", streams, lambda i, c, s: nccl.all_gather(ins[i], outs[i], c, s))

    def _divide(self, outs, streams, positions) -> None:
        for i in positions:
            with self._on(streams[i]):
                accumulate_(outs[i], (), ReduceOp.AVG, self.size)

    def _gather_reduce(self, ins, outs, op: ReduceOp, streams, kind: str, root: int) -> None:
        """For dtypes/ops NCCL cannot reduce: all-gather the bytes, then each member reduces in rank order."""
        P, n = self.size, ins[0].numel()
        stages = []
        for i, device in enumerate(self.local_devices):
            with self._on(streams[i]):
                stages.append(torch.empty(P * ins[i].nbytes, dtype=torch.uint8, device=device))
        self._all_gather_bytes([byte_view(t) for t in ins], stages, streams)
        for i in self._receivers(kind, root):
            rows = stages[i].view(ins[0].dtype).view(P, n)  # rows[s] = member s's input
            if kind == "scatter":
                step, m = n // P, self.local[i]
                rows = rows[:, m * step : (m + 1) * step]
            with self._on(streams[i]):
                outs[i].copy_(rows[0])
                accumulate_(outs[i], list(rows[1:]), op, P)

    def all_reduce(
        self, member: int, seq: int, call: Call, tensors: list[torch.Tensor], op: ReduceOp
    ) -> NcclWork:
        """`tensors`: this member's contiguous tensors (several for a coalesced all-reduce: one buffer)."""

        def launch(payloads: list[list[torch.Tensor]], streams) -> None:
            bufs = []
            for ts, stream in zip(payloads, streams):
                if len(ts) == 1:
                    bufs.append(flat(ts[0]))
                else:
                    with self._on(stream):
                        bufs.append(torch.cat([flat(t) for t in ts]))
            self._reduce(bufs, bufs, op, streams, "all")
            for ts, buf, stream in zip(payloads, bufs, streams):
                if len(ts) > 1:
                    with self._on(stream):
                        torch._foreach_copy_([flat(t) for t in ts], list(buf.split([t.numel() for t in ts])))

        return self._post(member, seq, call, tensors, launch)

    def reduce(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, dst: int, op: ReduceOp
    ) -> NcclWork:
        def launch(payloads: list[torch.Tensor], streams) -> None:
            bufs = [flat(t) for t in payloads]
            self._reduce(bufs, bufs, op, streams, "root", root=dst)

        return self._post(member, seq, call, tensor, launch)

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
    ) -> NcclWork:
        def launch(payloads, streams) -> None:
            ins, outs = [], []
            for (out, parts), stream in zip(payloads, streams):
                whole = contiguous_span(parts)  # reduce_scatter_tensor: the input is already one buffer
                if whole is None:
                    with self._on(stream):
                        whole = torch.cat([flat(p) for p in parts])
                ins.append(whole)
                outs.append(self._contiguous(out, stream))
            self._reduce(ins, [flat(o) for o in outs], op, streams, "scatter")
            for (out, _), staged, stream in zip(payloads, outs, streams):
                if staged is not out:
                    with self._on(stream):
                        out.copy_(staged)

        return self._post(member, seq, call, (output, inputs), launch)

    # data movement ----------------------------------------------------------------------------------------------
    def broadcast(self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int) -> NcclWork:
        def launch(payloads: list[torch.Tensor], streams) -> None:
            if payloads[0].numel():
                self._broadcast_bytes([byte_view(t) for t in payloads], src, streams)

        return self._post(member, seq, call, tensor, launch)

    def _broadcast_bytes(self, data: list[torch.Tensor], src: int, streams) -> None:
        """Every local member's `data` (uint8, one per local member) <- member `src`'s: ncclBroadcast in
        place from NCCL rank `src` (a group index), in one process and across processes alike."""
        nccl = self._runtime.nccl
        self._nccl("broadcast", streams, lambda i, c, s: nccl.broadcast(data[i], data[i], src, c, s))

    def all_gather(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], tensor: torch.Tensor
    ) -> NcclWork:
        def launch(payloads, streams) -> None:
            if payloads[0][1].numel() == 0:
                return
            ins, bufs, staged = [], [], []
            for (outs, t), stream, device in zip(payloads, streams, self.local_devices):
                ins.append(byte_view(self._contiguous(t, stream)))
                whole = contiguous_span(outs)  # all_gather_into_tensor: gather straight into the output
                staged.append(whole is None)
                if whole is None:
                    with self._on(stream):
                        whole = torch.empty(self.size * t.nbytes, dtype=torch.uint8, device=device)
                bufs.append(byte_view(whole))
            self._all_gather_bytes(ins, bufs, streams)
            for (outs, t), buf, stream, copy_out in zip(payloads, bufs, streams, staged):
                if copy_out:  # separate output tensors: copy the chunks out on the comm stream
                    chunks = buf.view(t.dtype).view(self.size, *t.shape)
                    with self._on(stream):
                        torch._foreach_copy_(list(outs), list(chunks.unbind(0)))

        return self._post(member, seq, call, (outputs, tensor), launch)

    def barrier(self, member: int, seq: int, call: Call, timeout: float | None = None) -> NcclWork:
        """A host barrier: done when every member has reached it (it orders no device work)."""
        arrival = self.rendezvous.post(self.local_index[member], seq, call, None, timeout=timeout)
        return self._work(member, seq, call, arrival=arrival)


def _device_id(device: torch.device, rank: int, local_ranks: range) -> int:
    """The CUDA device index NCCL binds a member's communicator to. CPU devices carry none: a world on CPU
    devices (the test double's, tests/fakes) numbers its rank threads' devices by their place in this
    process, as its fake GPUs are numbered; -1 for a member in another process (never initialised here)."""
    if device.index is not None:
        return device.index
    return local_ranks.index(rank) if rank in local_ranks else -1


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """A callable that runs `method` while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call
