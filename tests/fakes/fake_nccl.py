"""Test double of NCCL's C API (nccl.h): `FakeNccl` (one per simulated process) over a shared `FakeFabric`.

It stands where threadpar.comm.nccl.library.NcclLibrary stands (the NcclApi seam: one method per C function,
tensors for buffers), so every line of the backend above the binding runs against it. Its operations run on
the double's device (fake_device.py): a call returns at once, and the *stream* waits for the peers' matching
calls. What it enforces, each rule with the NCCL (or CUDA) source it mirrors:
- Communicators: ncclCommInitRank blocks until every rank of the unique id has joined, with no timeout
  (nccl.h; the double gives up after fake_device.WAIT_TIMEOUT_S with a HangError: "would wait for ever"); one
  rank per device in a communicator ("Duplicate GPU detected", ncclInvalidUsage: src/init.cc); rank in range.
- A freed communicator (ncclCommAbort, ncclCommDestroy: src/init.cc, commReclaim frees it) is undefined
  behaviour to touch: any call on one is a violation, raised and recorded (`violations`), never an NCCL error
  a caller could mistake for a normal failure.
- Threads (user guide, usage/threadsafety.html): one thread at a time may issue operations on the
  communicators of a device ("it is not safe to issue NCCL operations in parallel to independent
  communicators located on the same device with multiple threads"; NCCL 2.26+ reports "host threads racing
  to launch NCCL on same device": src/misc/strongstream.cc, NCCL_LAUNCH_RACE_FATAL); a group's operations
  hold the device until its end (all of a group's calls from one thread); ncclCommAbort only while no other
  thread is inside NCCL on it (usage/communicators.html, "Fault Tolerance"). A call from a second thread
  while the first is inside one is a violation.
- Streams: a kernel launched to a stream of another device than the current one fails (CUDA C Programming
  Guide, "Stream and Event Behavior"); NCCL launches with its communicator's device current, so a stream of
  another fake GPU is ncclUnhandledCudaError.
- Groups: ncclGroupStart/End nest per thread (src/group.cc: ncclGroupDepth is thread-local), an end without a
  start is ncclInvalidUsage (ncclGroupEndInternal), the operations of a group are launched at its outermost
  end (usage/groups.html); an operation outside a group is a group of its own.
- Collectives: every rank of a communicator issues the same collective with the same count, type, op and
  root, in the same order (else NCCL hangs or corrupts: the double fails the operation, which every
  stream that ran it surfaces, and records it in `fabric.mismatches`); buffers large enough for the communicator's size (nccl.h); the root of ncclReduce
  has a recvbuff; in-place only as usage/inplace.html defines it; ncclRedOp_t without bitwise ops; ncclAvg
  as NCCL computes it (fake_nccl_math.py); user-created pre-multiplied sums per communicator and datatype,
  refused on another datatype or communicator or once destroyed (fake_nccl_user_ops.py).
- Point to point: ncclSend/ncclRecv match per (communicator, peer) in issue order, with the same count and
  type (usage/p2p.html); a send blocks its stream until the receive runs ("blocking for the GPU", nccl.h).
- Connections: point-to-point connections are made on first use, whatever NCCL_RUNTIME_CONNECT says, and with
  NCCL_RUNTIME_CONNECT=1 (the default since 2.22; read once per process, at its first communicator:
  src/init.cc, src/include/param.h) a collective algorithm's are too: such a first use blocks the HOST inside
  the group end until the peers' parts are issued (src/enqueue.cc, src/transport.cc). (The double keys
  "algorithm" by collective: NCCL picks ring/tree/NVLS per call.)
- Nonblocking communicators (config.blocking = 0): from NCCL 2.23 every group end with one hands the launch
  to a new thread of NCCL's and returns ncclInProgress (src/group.cc, ncclGroupEndInternal:
  pthread_create(groupLaunchNonBlocking), ret = ncclInProgress); its kernels reach their streams when that
  thread is done, and the communicator reports ncclInProgress until then (a thread of the double's launches
  them after `nonblocking_launch_s`). Before 2.23 only a group that connects or initialises goes to that
  thread. Blocking and nonblocking communicators in one group are ncclInvalidUsage (src/group.cc,
  taskAppend's check: "Blocking and nonblocking communicators are not allowed in the same group").
- Order on the device: a communicator's launches run one after another, in the order they were issued,
  whatever streams they were issued on (src/enqueue.cc, ncclLaunchPrepare: the launch stream waits on the
  communicator's deviceStream; ncclLaunchFinish: deviceStream then advances to the launch). So two ranks
  that issue a send and a receive to each other on one communicator as separate launches, both sends first,
  wait for each other for ever; the double reports it as a hang.
- Memory: each communicator's NCCL buffers are counted on its fake GPU (fake_nccl_memory.py, NCCL's
  constants): its collectives' at ncclCommInitRank with NCCL_RUNTIME_CONNECT=0 (at its first collective
  otherwise), a peer's point-to-point buffers at its first use in each direction; freed by abort and destroy.
  `device_bytes(gpu)` and `live_communicators(gpu)` let a test count them.
- Failures: ncclCommAbort ends the communicator's kernels on its streams (their streams go on; a stream's
  later synchronization sees the failure) and frees it; the peers' parts keep waiting, as on a GPU, until
  they abort too. ncclCommDestroy waits for the communicator's launched operations (src/init.cc,
  commDestroySync): with one whose peer never comes, it would hang (HangError). An asynchronous error is
  what ncclCommGetAsyncError reports (`async_error_code`).
It also models the one torch.cuda.nccl fact threadpar must never meet again: `init_rank` raises SystemError
on CPython 3.10-3.12 (pytorch#38019; tests/conftest.py installs `broken_torch_init_rank`).

Cliques span simulated processes (threadpar.testing runs several in one interpreter).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from threadpar.errors import NcclError

from . import fake_device, fake_graph, sim_gpu
from .fake_device import DeviceOp, HangError, Kernel, Part
from .fake_nccl_math import INVALID_ARGUMENT, INVALID_USAGE, compute, nccl_error
from .fake_nccl_memory import NcclMemoryModel
from .fake_nccl_user_ops import FIRST_VERSION as PRE_MUL_SUM_VERSION
from .fake_nccl_user_ops import UserRedOps

# The dtypes that have an ncclDataType_t (nccl.h); bool travels as uint8 (library.data_type), for data
# movement only (threadpar never reduces bool through NCCL: nccl/reduction.py gathers it).
NCCL_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
UNHANDLED_CUDA_ERROR = 1
SUCCESS, IN_PROGRESS = 0, 7
# From this version every group end on a nonblocking communicator launches on a thread of NCCL's (src/group.cc,
# ncclGroupEndInternal, v2.23.4: `if (ncclGroupBlocking == 0)`; v2.22.3 still required a connection or an init).
THREADED_LAUNCH_VERSION = (2, 23)


class FakeComm(NamedTuple):
    uid: bytes
    rank: int
    size: int
    thread: str
    process: int  # which FakeNccl (simulated process) created it
    lazy: bool = False  # NCCL >= 2.22 with NCCL_RUNTIME_CONNECT=1: connects collectives on first use
    device: int = 0  # the (fake) CUDA device it is bound to
    blocking: bool = True  # config.blocking (ncclCommInitRankConfig)


class CollectiveOp(DeviceOp):
    """The k-th collective of one clique."""

    def __init__(self, kind: str, args: tuple, size: int, uid: bytes, index: int) -> None:
        super().__init__(f"{kind} #{index} of clique {uid[:8]!r}", size, compute)
        self.kind = kind
        self.args = args  # what every rank must agree on: (count, dtype, op, root)
        # rank -> its user-created op's scalar (a pre-multiplied sum)
        self.scalars: dict[int, torch.Tensor] = {}


class P2pOp(DeviceOp):
    """One ncclSend matched with one ncclRecv (parts 0: the send, 1: the receive)."""

    def __init__(self, uid: bytes, src: int, dst: int) -> None:
        super().__init__(f"send/recv {src} -> {dst} on clique {uid[:8]!r}", 2, _transfer)


def _transfer(op: DeviceOp) -> str | None:
    send, recv = op.parts[0].input, op.parts[1].output
    assert send is not None and recv is not None
    recv.copy_(send)
    return None


class FakeFabric:
    """What the NCCLs of all simulated processes share: unique ids, cliques joining, operations matching."""

    def __init__(self) -> None:
        self.cond = threading.Condition()  # joins
        self._ids = itertools.count()
        self._processes = itertools.count()
        self._joining: dict[bytes, set[int]] = {}
        self._failed: set[bytes] = set()  # cliques whose init failed
        self._devices: dict[tuple[bytes, int, int], int] = {}  # (clique, process, device) -> its rank
        self.owner: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> process holding that communicator
        # Under fake_device.RUN_LOCK: the collectives each rank issued, the operations not yet complete,
        # the unmatched sends and receives of each (clique, src, dst), the communicators freed.
        self._issued: dict[tuple[bytes, int], int] = {}
        self._ops: dict[tuple[bytes, int], CollectiveOp] = {}
        self._sends: dict[tuple[bytes, int, int], deque[P2pOp]] = {}
        self._recvs: dict[tuple[bytes, int, int], deque[P2pOp]] = {}
        self.freed: dict[tuple[bytes, int], str] = {}  # (clique, rank) -> "aborted" / "destroyed"
        self.id_makers: dict[bytes, str] = {}  # unique id -> the thread that made it
        self.mismatches: list[str] = []  # operations whose ranks called different collectives (or sizes)

    def new_process(self) -> int:
        return next(self._processes)

    def unique_id(self) -> bytes:
        uid = f"uid-{next(self._ids)}".encode().ljust(128, b"\0")  # NCCL_UNIQUE_ID_BYTES
        with self.cond:
            self.id_makers[uid] = threading.current_thread().name
        return uid

    def join(self, num_ranks: int, uid: bytes, rank: int, process: int, device: int) -> None:
        with self.cond:
            other = self._devices.get((uid, process, device))
            if other is not None:
                self._failed.add(uid)  # (every rank's init fails: NCCL checks in the collective bootstrap)
                self.cond.notify_all()
                # src/init.cc (initTransportsRank): two ranks of one communicator with the same host hash and
                # bus id: WARN "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx",
                # ncclInvalidUsage. (Processes of the double are distinct hosts: the key holds the process.)
                raise nccl_error(
                    "ncclCommInitRank", INVALID_USAGE,
                    f"Duplicate GPU detected: rank {other} and rank {rank} both on CUDA device {device}",
                )  # fmt: skip
            self._devices[uid, process, device] = rank
            joined = self._joining.setdefault(uid, set())
            joined.add(rank)
            self.owner[uid, rank] = process
            self.cond.notify_all()
            timeout = fake_device.WAIT_TIMEOUT_S
            if not self.cond.wait_for(lambda: len(joined) == num_ranks or uid in self._failed, timeout):
                raise HangError(
                    f"ncclCommInitRank of rank {rank}: ranks {sorted(joined)} of {num_ranks} joined within "
                    f"{timeout:g} s (NCCL waits for ever: a blocking init has no timeout)"
                )
            if uid in self._failed:
                raise nccl_error(
                    "ncclCommInitRank", INVALID_USAGE, "Duplicate GPU detected (another rank's init)"
                )

    # matching parts to operations (the caller holds fake_device.RUN_LOCK) ---------------------------------------
    def collective(self, comm: FakeComm, kind: str, args: tuple) -> tuple[CollectiveOp, str | None]:
        """The operation this rank's next collective on the clique is part of; and an error if it differs
        from what the ranks that issued it first called."""
        uid = comm.uid
        index = self._issued.get((uid, comm.rank), 0)
        self._issued[uid, comm.rank] = index + 1
        op = self._ops.get((uid, index))
        if op is None:
            op = self._ops[uid, index] = CollectiveOp(kind, args, comm.size, uid, index)
        if len(op.parts) + 1 == comm.size:
            del self._ops[uid, index]  # (complete once this part is added)
        if (op.kind, op.args) != (kind, args):
            return op, (
                f"NCCL collectives differ on clique {uid[:8]!r} at its collective #{index}: {op.kind}{op.args} "
                f"and {kind}{args} (NCCL would hang or corrupt data)"
            )
        return op, None

    def point_to_point(self, comm: FakeComm, peer: int, send: torch.Tensor | None, recv: torch.Tensor | None):
        """The P2pOp this send (or receive) is part of: usage/p2p.html, each ncclRecv from a peer matches the
        oldest unmatched ncclSend of that peer to this rank on this communicator; and an error if their counts
        or types differ."""
        src, dst = (comm.rank, peer) if send is not None else (peer, comm.rank)
        key = (comm.uid, src, dst)
        mine, theirs = (self._sends, self._recvs) if send is not None else (self._recvs, self._sends)
        waiting = theirs.get(key)
        if waiting:
            op = waiting.popleft()
            other = op.parts.get(1 if send is not None else 0)
            assert other is not None
            sent, received = (send, other.output) if send is not None else (other.input, recv)
            assert sent is not None and received is not None
            if (sent.numel(), sent.dtype) != (received.numel(), received.dtype):
                return op, (
                    f"NCCL send/recv {src} -> {dst}: the send has {sent.numel()} x {sent.dtype}, the receive "
                    f"{received.numel()} x {received.dtype} (usage/p2p.html: they must match)"
                )
            return op, None
        op = P2pOp(comm.uid, src, dst)
        mine.setdefault(key, deque()).append(op)
        return op, None

    def abort(self, comm: FakeComm, how: str, pending: list[Part]) -> None:
        """ncclCommAbort (or Destroy): the communicator is freed; its `pending` parts end (their streams go
        on, failed); the peers' parts wait on, as on a GPU, until they abort too (nccl.h: abort ends the
        communicator's uncompleted operations)."""
        with fake_device.RUN_LOCK:
            self.freed[comm.uid, comm.rank] = how
            message = f"NCCL communicator of rank {comm.rank} was aborted (ncclCommAbort) with this operation pending"
            for part in pending:
                if part.aborted is None:
                    part.aborted = message
                    fake_device.unregister(part)
                    part.input = part.output = None  # (its kernel ended: the device holds them no more)
            fake_device.CHANGED.notify_all()

    def join_later(self, num_ranks: int, uid: bytes, rank: int, process: int, device: int) -> None:
        """A nonblocking init's join: recorded at once; the communicator is ready once all have joined."""
        with self.cond:
            if (uid, process, device) in self._devices:
                raise nccl_error(
                    "ncclCommInitRankConfig", INVALID_USAGE, f"Duplicate GPU detected on device {device}"
                )
            self._devices[uid, process, device] = rank
            self._joining.setdefault(uid, set()).add(rank)
            self.owner[uid, rank] = process
            self.cond.notify_all()

    def joined(self, uid: bytes, num_ranks: int) -> bool:
        with self.cond:
            return len(self._joining.get(uid, ())) == num_ranks

    def ranks_held_by(self, uid: bytes, process: int) -> list[int]:
        with self.cond:
            return sorted(r for (u, r), p in self.owner.items() if u == uid and p == process)


class _Queued(NamedTuple):
    """An operation issued inside a group, launched at the group's end."""

    name: str
    args: tuple  # for collectives: (count, dtype, op, root); for p2p: (peer,)
    comm: FakeComm
    stream: Any
    input: torch.Tensor | None
    output: torch.Tensor | None
    extra: dict


class CommUsage(NamedTuple):
    """A communicator's use (FakeNccl.usage): its size, the collectives it ran (kernel names), the peers it
    sent to and received from (NCCL ranks)."""

    size: int
    collectives: frozenset[str]
    sends_to: frozenset[int]
    receives_from: frozenset[int]


_P2P_NAMES = frozenset({"send", "recv"})


class _Deferred:
    """A nonblocking group end's launch, which NCCL's own thread performs (module docstring)."""

    __slots__ = ("cancelled", "done", "keys", "queued", "thread")

    def __init__(self, queued: list[_Queued]) -> None:
        self.queued = queued
        self.keys = {(q.comm.uid, q.comm.rank) for q in queued}
        self.done = threading.Event()  # set once its kernels are enqueued (or it failed, or was aborted)
        self.cancelled = False  # an abort came first (src/group.cc, ncclGroupJobAbort)
        self.thread: threading.Thread | None = None


class FakeNccl:
    """NCCL's C API (the NcclApi seam) for one simulated process, with NCCL's rules (module docstring)."""

    def __init__(self, fake: Any, version: tuple[int, ...], fabric: FakeFabric | None = None) -> None:
        self.fake = fake
        self._version = tuple(version) + (0,) * (3 - len(version))
        self.fabric = FakeFabric() if fabric is None else fabric
        self.process = self.fabric.new_process()
        self.fail_next: dict[str, str] = {}  # C function name -> message of the error its next call raises
        self.async_error_code = 0  # what ncclCommGetAsyncError reports (0: ncclSuccess)
        self.init_calls: list[FakeComm] = []
        self.destroyed: list[FakeComm] = []
        self.aborted: list[FakeComm] = []
        # How long ncclCommInitRank works after the clique has joined (a real one takes 0.1-1 s: topology,
        # buffers, connections); tests raise it to widen windows.
        self.init_seconds = 0.0
        # How long ncclCommInitRank stalls before it joins (a process that never comes to the init: its peers'
        # inits wait for it).
        self.init_stall = 0.0
        self._lock = threading.Lock()
        self._active: dict[int, tuple[int, int]] = {}  # device -> (thread inside NCCL on it, depth)
        self._runtime_connect: bool | None = None  # NCCL_RUNTIME_CONNECT as NCCL read it (once per process)
        self._connected: set[tuple[Any, ...]] = set()  # connections this process made (lazy ones)
        self._local = threading.local()  # this thread's group: depth and queued operations
        self.violations: list[str] = []  # rules broken (also raised to the caller)
        # (clique, rank) -> the CUDA graphs that captured work on that communicator (weakly: id -> ref), and
        # one finalizer per graph (a graph collected without reset is destroyed as well); under _lock.
        self._graphs: dict[tuple[bytes, int], dict[int, Any]] = {}
        self._graph_finalizers: dict[int, Any] = {}
        # A nonblocking communicator's call still going on: (clique, rank) -> what it waits for (its init:
        # None; a connecting operation: that DeviceOp), until comm_get_async_error says it is done.
        self._in_progress: dict[tuple[bytes, int], DeviceOp | None] = {}
        # How long NCCL's launch thread takes with a nonblocking group end (tests raise it to widen the window).
        self.nonblocking_launch_s = 1e-4
        # (clique, rank) -> its launch on NCCL's thread, until done
        self._deferred: dict[tuple[bytes, int], _Deferred] = {}
        self._async_errors: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> what a failed launch left
        # (clique, rank) -> events after the communicator's last launch, on each stream it used: its next launch
        # waits for them (src/enqueue.cc: a communicator's launches run in issue order).
        self._lanes: dict[tuple[bytes, int], list[Any]] = {}
        self.memory = NcclMemoryModel()
        # (clique, rank) -> NCCL's buffers of a live communicator (fake_nccl_memory.py)
        self._bytes: dict[tuple[bytes, int], int] = {}
        self._comms: dict[tuple[bytes, int], FakeComm] = {}  # the live communicators of this process
        # ncclRedOpCreatePreMulSum's ops, per communicator (fake_nccl_user_ops.py)
        self.user_ops = UserRedOps()

    # version, errors, communicators -----------------------------------------------------------------------------
    def version(self) -> tuple[int, int, int]:
        return self._version  # type: ignore[return-value]

    def error_string(self, code: int) -> str:
        return {0: "no error", 1: "unhandled cuda error", 4: "invalid argument", 5: "invalid usage",
                6: "remote process exited or there was a network error"}.get(code, "unhandled error")  # fmt: skip

    def get_unique_id(self) -> bytes:
        self._fail_if_told("ncclGetUniqueId")
        return self.fabric.unique_id()

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, device: int) -> FakeComm:
        self._fail_if_told("ncclCommInitRank")
        if (
            not 0 <= rank < nranks
        ):  # src/init.cc, ncclCommInitRankDev: "rank %d nranks %d" -> ncclInvalidArgument
            raise nccl_error("ncclCommInitRank", INVALID_ARGUMENT, f"rank {rank} is not in [0, {nranks})")
        lazy = self._lazy()
        with self._on_device(device, "ncclCommInitRank"):
            if self.init_stall:
                time.sleep(self.init_stall)
            self.fabric.join(nranks, unique_id, rank, self.process, device)
            if self.init_seconds:
                time.sleep(self.init_seconds)
        comm = FakeComm(unique_id, rank, nranks, threading.current_thread().name, self.process, lazy, device)
        with self._lock:
            self.init_calls.append(comm)
        self._made(comm)
        return comm

    def comm_init_rank_config(
        self, nranks: int, unique_id: bytes, rank: int, device: int, blocking: bool
    ) -> FakeComm:
        """ncclCommInitRankConfig (NCCL >= 2.14): blocking as comm_init_rank; nonblocking returns at once
        (ncclInProgress) and the communicator is ready once every rank joined (src/init.cc, ncclCommInitRankDev
        runs the init as an async job; ncclCommGetAsyncError reports ncclInProgress until it ends)."""
        if blocking:
            return self.comm_init_rank(nranks, unique_id, rank, device)
        self._fail_if_told("ncclCommInitRankConfig")
        if self._version[:2] < (2, 14):
            raise nccl_error(
                "ncclCommInitRankConfig", INVALID_USAGE, "no nonblocking communicators before 2.14"
            )
        if not 0 <= rank < nranks:
            raise nccl_error(
                "ncclCommInitRankConfig", INVALID_ARGUMENT, f"rank {rank} is not in [0, {nranks})"
            )
        lazy = self._lazy()
        with self._on_device(device, "ncclCommInitRankConfig"):
            self.fabric.join_later(nranks, unique_id, rank, self.process, device)
        comm = FakeComm(
            unique_id,
            rank,
            nranks,
            threading.current_thread().name,
            self.process,
            lazy,
            device,
            blocking=False,
        )
        with self._lock:
            self.init_calls.append(comm)
            self._in_progress[unique_id, rank] = None
        self._made(comm)
        return comm

    def comm_init_all(self, devices: Sequence[int]) -> list[FakeComm]:
        """ncclCommInitAll (src/init.cc): a unique id of its own, then every rank initialised from this one
        thread inside a group (so none waits for the others); duplicate devices fail as in comm_init_rank."""
        self._fail_if_told("ncclCommInitAll")
        uid, n, lazy = self.fabric.unique_id(), len(devices), self._lazy()
        comms: list[Any] = [None] * n
        errors: list[BaseException] = []

        def join(i: int) -> None:
            try:
                self.fabric.join(n, uid, i, self.process, devices[i])
                comms[i] = FakeComm(
                    uid, i, n, threading.current_thread().name, self.process, lazy, devices[i]
                )
            except BaseException as error:
                errors.append(error)

        for device in sorted(set(devices)):
            self._enter_device(device, "ncclCommInitAll")
        try:
            joiners = [threading.Thread(target=join, args=(i,)) for i in range(n)]
            for t in joiners:
                t.start()
            for t in joiners:
                t.join()
        finally:
            for device in sorted(set(devices)):
                self._leave_device(device)
        if errors:
            raise errors[0]
        with self._lock:
            self.init_calls.extend(comms)
        for comm in comms:
            self._made(comm)
        return comms

    def comm_destroy(self, comm: FakeComm) -> None:
        """ncclCommDestroy waits for the communicator's launched operations (src/init.cc, commDestroySync),
        then frees it."""
        self._check_usable(comm, "ncclCommDestroy")
        self._busy(comm, finish=True)  # (a launch NCCL's thread still has is done first)
        with self._on_device(comm.device, "ncclCommDestroy"):
            for part in self._pending(comm):
                assert part.kernel is not None
                fake_device.demand(
                    part.kernel.stream, part.kernel.index, f"ncclCommDestroy waiting for {part.op.name}"
                )
            self.fabric.abort(comm, "destroyed", [])
            self._reclaim(comm, "ncclCommDestroy")
        with self._lock:
            self.destroyed.append(comm)
        self._freed(comm)

    def comm_abort(self, comm: FakeComm) -> None:
        self._check_usable(comm, "ncclCommAbort")
        with self._lock:  # (NCCL's launch thread is told to stop: src/group.cc, ncclGroupJobAbort)
            job = self._deferred.pop((comm.uid, comm.rank), None)
            if job is not None:
                job.cancelled = True
        with self._on_device(comm.device, "ncclCommAbort"):
            self.fabric.abort(comm, "aborted", self._pending(comm))
            self._reclaim(comm, "ncclCommAbort")
        with self._lock:
            self.aborted.append(comm)
        self._freed(comm)

    # CUDA graphs that captured a communicator's work -------------------------------------------------------------
    def _captured_by(self, graph: Any, comm: FakeComm) -> None:
        with self._lock:
            self._graphs.setdefault((comm.uid, comm.rank), {})[id(graph)] = weakref.ref(graph)
            if id(graph) not in self._graph_finalizers:  # (a graph dropped without reset is destroyed too)
                self._graph_finalizers[id(graph)] = weakref.finalize(graph, self._forget_graph, id(graph))

    def graph_gone(self, graph: Any) -> None:
        """A graph was reset (or collected): its NCCL plans are reclaimed (src/enqueue.cc, reclaimPlan)."""
        self._forget_graph(id(graph))

    def _forget_graph(self, key: int) -> None:
        with self._lock:
            for graphs in self._graphs.values():
                graphs.pop(key, None)
            finalizer = self._graph_finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()

    def _reclaim(self, comm: FakeComm, function: str) -> None:
        """The last destroy or abort of a clique's communicators in this process reclaims them all, and NCCL
        >= 2.26 keeps polling there until every CUDA graph that captured work on any of them is destroyed
        (src/init.cc, commReclaim -> commDestroySync: "keep polling until all graphs referencing us die",
        localPersistentRefs): with one alive, the calling thread never returns."""
        if self._version[:2] < (2, 26):
            return
        local = self.fabric.ranks_held_by(comm.uid, self.process)
        if any((comm.uid, r) not in self.fabric.freed for r in local):
            return  # (not the last of this process's members: NCCL's finalizeRankCnt not complete)
        with self._lock:
            alive = [
                g
                for r in local
                for ref in self._graphs.get((comm.uid, r), {}).values()
                if (g := ref()) is not None
            ]
        if alive:
            message = (
                f"{function} of the last of this process's communicators of clique {comm.uid[:8]!r} would wait for "
                f"ever: {len(alive)} CUDA graph(s) that captured work on them are alive (NCCL >= 2.26, src/init.cc "
                "commDestroySync: it polls until every graph referencing them is destroyed); reset or drop the "
                "graphs first"
            )
            self._violation(message)
            raise HangError(message)

    def comm_get_async_error(self, comm: FakeComm) -> int:
        self._check_usable(comm, "ncclCommGetAsyncError")
        with self._on_device(comm.device, "ncclCommGetAsyncError"):
            if self._busy(comm):
                return IN_PROGRESS
            with self._lock:
                failed = self._async_errors.get((comm.uid, comm.rank))
            return self.async_error_code if failed is None else failed

    def _busy(self, comm: FakeComm, finish: bool = False) -> bool:
        """A nonblocking communicator's last call still goes on: its launch on NCCL's thread (`finish`: wait
        for that), its init, or a connecting operation."""
        key = (comm.uid, comm.rank)
        with self._lock:
            job = self._deferred.get(key)
        if job is not None:
            if finish:
                job.done.wait(fake_device.WAIT_TIMEOUT_S)
            if not job.done.is_set():
                return True
        with self._lock:
            if key not in self._in_progress:
                return False
            waiting = self._in_progress[key]
        done = (
            self.fabric.joined(comm.uid, comm.size) if waiting is None else len(waiting.parts) == waiting.size
        )
        if done:
            with self._lock:
                self._in_progress.pop(key, None)
        return not done

    def _pending(self, comm: FakeComm) -> list[Part]:
        """The communicator's parts not yet run (on this process's streams, where its kernels are)."""
        with fake_device.RUN_LOCK:
            return [
                part
                for stream in list(self.fake.streams_made)
                for kernel in stream.kernels.values()
                for part in kernel.parts
                if part.comm_key == (comm.uid, comm.rank) and not part.op.done and part.aborted is None
            ]

    # memory ----------------------------------------------------------------------------------------------------
    def _made(self, comm: FakeComm) -> None:
        """A new communicator: with NCCL_RUNTIME_CONNECT=0 its collectives' buffers now (module docstring)."""
        with self._lock:
            self._comms[comm.uid, comm.rank] = comm
            self._bytes[comm.uid, comm.rank] = 0 if comm.lazy else self.memory.collectives(comm.size)

    def _charge(self, comm: FakeComm, nbytes: int) -> None:
        with self._lock:
            key = (comm.uid, comm.rank)
            if key in self._bytes:
                self._bytes[key] += nbytes

    def _freed(self, comm: FakeComm) -> None:
        self.user_ops.forget((comm.uid, comm.rank))  # (commFree deletes its user ops: fake_nccl_user_ops.py)
        with self._lock:
            self._bytes.pop((comm.uid, comm.rank), None)
            self._comms.pop((comm.uid, comm.rank), None)
            self._lanes.pop((comm.uid, comm.rank), None)

    def device_bytes(self, device: int) -> int:
        """NCCL's buffers of the live communicators on fake GPU `device` (fake_nccl_memory.py)."""
        with self._lock:
            return sum(n for key, n in self._bytes.items() if self._comms[key].device == device)

    def live_communicators(self, device: int) -> list[FakeComm]:
        """The communicators on fake GPU `device` neither aborted nor destroyed."""
        with self._lock:
            return [c for c in self._comms.values() if c.device == device]

    def usage(self, comm: FakeComm) -> CommUsage:
        """What a communicator of this process was used for: its collectives and its point-to-point peers."""
        with self._lock:
            collectives = {
                n for c in self.fake.calls if c.comm == comm for n in c.name.split("+")
            } - _P2P_NAMES
            peers = [c[3:] for c in self._connected if c[0] == "p2p" and c[1:3] == (comm.uid, comm.rank)]
        return CommUsage(
            comm.size,
            frozenset(collectives),
            frozenset(p for p, how in peers if how == "send"),
            frozenset(p for p, how in peers if how == "recv"),
        )

    # groups -----------------------------------------------------------------------------------------------------
    def _group(self) -> tuple[int, list[_Queued]]:
        local = self._local
        if not hasattr(local, "depth"):
            local.depth, local.queued = 0, []
        return local.depth, local.queued

    def group_start(self) -> None:
        depth, _ = self._group()
        self._local.depth = depth + 1

    def group_end(self) -> int:
        depth, queued = self._group()
        if depth == 0:  # src/group.cc, ncclGroupEndInternal: "ncclGroupEnd: not in a group call."
            raise nccl_error("ncclGroupEnd", INVALID_USAGE, "not in a group call (no ncclGroupStart)")
        self._local.depth = depth - 1
        if depth > 1:
            return SUCCESS
        self._local.queued = []
        try:
            blocking = {q.comm.blocking for q in queued}
            if len(blocking) > 1:
                raise nccl_error(
                    "ncclGroupEnd", INVALID_USAGE,
                    "Blocking and nonblocking communicators are not allowed in the same group.",
                )  # fmt: skip
            replaying = getattr(self._local, "replaying", False)
            if blocking == {False} and self._version[:2] >= THREADED_LAUNCH_VERSION and not replaying:
                return self._launch_on_thread(queued)
            return self._launch(queued)
        finally:
            for q in queued:  # (the host's part is done: the group's calls let go of their devices)
                self._leave_device(q.comm.device)

    # user-created reductions (fake_nccl_user_ops.py) ------------------------------------------------------------
    def red_op_create_pre_mul_sum(self, scalar: float, dtype: torch.dtype, comm: FakeComm) -> int:
        self._require("ncclRedOpCreatePreMulSum")
        self._check_usable(comm, "ncclRedOpCreatePreMulSum")
        self._check_ready(comm, "ncclRedOpCreatePreMulSum")  # (ncclCommEnsureReady)
        with self._on_device(comm.device, "ncclRedOpCreatePreMulSum"):
            return self.user_ops.create((comm.uid, comm.rank), scalar, dtype)

    def red_op_destroy(self, op: int, comm: FakeComm) -> None:
        self._require("ncclRedOpDestroy")
        self._check_usable(comm, "ncclRedOpDestroy")
        with self._on_device(comm.device, "ncclRedOpDestroy"):
            self.user_ops.destroy((comm.uid, comm.rank), op)

    def _require(self, function: str) -> None:
        """An older NCCL has no such symbol: the binding refuses as library.NcclLibrary._require does."""
        if self._version[:2] < PRE_MUL_SUM_VERSION:
            raise NcclError(f"NCCL {self._version} has no {function} (NCCL 2.11+)")

    def _reduction(self, function: str, op: int, comm: FakeComm, dtype: torch.dtype) -> tuple[Any, dict]:
        """The op every rank's call is compared by, and what the queued call carries (fake_nccl_user_ops)."""
        resolved, user = self.user_ops.resolve(function, (comm.uid, comm.rank), op, dtype)
        return resolved, ({"op": op} if user is None else {"op": op, "scalar": user.scalar})

    # collectives and point to point (the C functions' arguments, tensors for buffers) ---------------------------
    def all_reduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: FakeComm, stream: Any
    ) -> None:
        self._check_usable(comm, "ncclAllReduce")
        nop, extra = self._reduction("ncclAllReduce", op, comm, send.dtype)
        self._queue("all_reduce", (send.numel(), send.dtype, nop, None), comm, stream, send, recv, reduces=True,
                    **extra)  # fmt: skip

    def broadcast(
        self, send: torch.Tensor, recv: torch.Tensor, root: int, comm: FakeComm, stream: Any
    ) -> None:
        self._check_root("ncclBroadcast", root, comm)
        self._queue("broadcast", (recv.numel(), recv.dtype, None, root), comm, stream, send, recv, root=root)

    def reduce(
        self, send: torch.Tensor, recv: torch.Tensor | None, root: int, op: int, comm: FakeComm, stream: Any
    ) -> None:
        self._check_usable(comm, "ncclReduce")
        nop, extra = self._reduction("ncclReduce", op, comm, send.dtype)
        self._check_root("ncclReduce", root, comm)
        self._queue("reduce", (send.numel(), send.dtype, nop, root), comm, stream, send, recv, reduces=True,
                    root=root, **extra)  # fmt: skip

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor, comm: FakeComm, stream: Any) -> None:
        self._queue("all_gather", (send.numel(), send.dtype, None, None), comm, stream, send, recv)

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: FakeComm, stream: Any
    ) -> None:
        self._check_usable(comm, "ncclReduceScatter")
        nop, extra = self._reduction("ncclReduceScatter", op, comm, recv.dtype)
        self._queue("reduce_scatter", (recv.numel(), recv.dtype, nop, None), comm, stream, send, recv,
                    reduces=True, **extra)  # fmt: skip

    def send(self, tensor: torch.Tensor, peer: int, comm: FakeComm, stream: Any) -> None:
        self._check_root("ncclSend", peer, comm)
        self._queue("send", (peer,), comm, stream, tensor, None, peer=peer)

    def recv(self, tensor: torch.Tensor, peer: int, comm: FakeComm, stream: Any) -> None:
        self._check_root("ncclRecv", peer, comm)
        self._queue("recv", (peer,), comm, stream, None, tensor, peer=peer)

    # what NCCL checks -------------------------------------------------------------------------------------------
    def _fail_if_told(self, function: str) -> None:
        message = self.fail_next.pop(function, None)
        if message is not None:
            raise nccl_error(function, 3, message)

    @staticmethod
    def _check_root(function: str, root: int, comm: FakeComm) -> None:
        if not 0 <= root < comm.size:  # src/enqueue.cc, ArgsCheck: "invalid root %d (root should be in the
            # 0..%d range)" -> ncclInvalidArgument (peers of send/recv alike: "invalid peer")
            raise nccl_error(function, INVALID_ARGUMENT, f"root/peer {root} is not in [0, {comm.size})")

    def _queue(
        self, name, args, comm, stream, send, recv, *, reduces=False, racing=True, replay=False, **extra
    ):
        """`replay`: a graph's captured call again, its buffers the device memory recorded at capture."""
        function = _C_NAMES[name]
        self._check_usable(comm, function)
        if not getattr(self._local, "replaying", False):
            self._check_ready(comm, function)
        self._fail_if_told(function)
        assert isinstance(comm, FakeComm), f"{function}: not a communicator: {comm!r}"
        assert stream is not None, f"{function}: no stream"
        self._check_buffers(function, send if send is not None else recv, recv, reduces)
        self._check_stream(function, comm, stream)
        if not replay:
            send = self._memory(function, send, comm, "sendbuff")
            recv = self._memory(function, recv, comm, "recvbuff")
        if racing:
            self._enter_device(comm.device, function)  # held until the group's end
        self.group_start()  # (an operation outside a group is a group of its own: src/collectives.cc)
        _, queued = self._group()
        queued.append(_Queued(name, args, comm, stream, send, recv, extra))
        self.group_end()

    def _check_buffers(
        self, function: str, send: torch.Tensor, recv: torch.Tensor | None, reduces: bool
    ) -> None:
        dtype = send.dtype
        old = self._version[:2] < (2, 10)
        if dtype not in NCCL_DTYPES - ({torch.bfloat16} if old else set()) and not (
            dtype == torch.bool and not reduces
        ):  # library.data_type refuses it before NCCL is called
            raise NcclError(f"NCCL has no data type for {dtype} (ncclDataType_t in nccl.h)")
        for t in (send, recv):
            if t is not None:
                assert t.dtype == dtype and t.is_contiguous(), (
                    f"{function}: buffers must be contiguous {dtype}"
                )

    def _memory(
        self, function: str, t: torch.Tensor | None, comm: FakeComm, name: str
    ) -> torch.Tensor | None:
        """The device memory of a buffer: a tensor on the communicator's GPU. NCCL's kernels read and write
        device memory; src/misc/argcheck.cc, CudaPtrCheck, names "%s %p is not a valid pointer" and "%s
        allocated on device %d mismatchs with NCCL device %d" when pointer checks are on (NCCL_CHECK_POINTERS),
        and without them a host buffer faults the kernel (an illegal address): a violation either way."""
        if t is None:
            return None
        if not sim_gpu.is_device(t):
            raise self._violation(
                f"{function}: {name} is a tensor on {t.device}, not GPU memory (argcheck.cc, CudaPtrCheck: not a "
                "valid pointer; unchecked, the kernel faults): NCCL takes device tensors"
            )
        if t.device.index != comm.device:
            raise self._violation(
                f"{function}: {name} allocated on device {t.device.index} mismatchs with NCCL device {comm.device} "
                "(argcheck.cc, CudaPtrCheck)"
            )
        return sim_gpu.host(t)

    def _check_stream(self, function: str, comm: FakeComm, stream: Any) -> None:
        """CUDA C Programming Guide, "Stream and Event Behavior": a kernel launch fails if it is issued to a
        stream that is not associated to the current device; NCCL makes its communicator's device current to
        launch (src/enqueue.cc), so a stream of another device fails the call."""
        if stream.device_index != comm.device:
            raise nccl_error(
                function, UNHANDLED_CUDA_ERROR,
                f"CUDA error: invalid resource handle: {stream!r} belongs to fake GPU {stream.device_index}, the "
                f"communicator to GPU {comm.device} (a kernel cannot be launched to another device's stream)",
            )  # fmt: skip

    def _lazy(self) -> bool:
        """Whether a communicator made now connects collectives lazily: src/init.cc sets comm->runtimeConn from
        ncclParamRuntimeConnect() (NCCL_PARAM(RuntimeConnect, "RUNTIME_CONNECT", 1), NCCL >= 2.22), a value
        NCCL reads from the environment once per process and caches (src/include/param.h), hence once here."""
        with self._lock:
            if self._runtime_connect is None:
                self._runtime_connect = self._version[:2] >= (2, 22) and os.environ.get(
                    "NCCL_RUNTIME_CONNECT", "1"
                ).strip() not in ("0", "")
            return self._runtime_connect

    def _violation(self, message: str) -> RuntimeError:
        with self._lock:
            self.violations.append(message)
        return RuntimeError(message)

    def _check_ready(self, comm: FakeComm, function: str) -> None:
        """src/init.cc, ncclCommEnsureReady (from ncclEnqueueCheck): a call on a nonblocking communicator whose
        previous call has not returned ncclSuccess yet fails with ncclInvalidArgument ("Attempt to use
        communicator before the previous operation returned ncclSuccess"); the user guide says to poll
        ncclCommGetAsyncError until ncclSuccess before calling another NCCL function."""
        if self._busy(comm):
            self._violation(f"{function} on a nonblocking communicator still in progress (rank {comm.rank})")
            raise nccl_error(
                function,
                INVALID_ARGUMENT,
                "Attempt to use communicator before the previous operation returned ncclSuccess",
            )

    def _check_usable(self, comm: FakeComm, function: str) -> None:
        how = self.fabric.freed.get((comm.uid, comm.rank))
        if how is not None:
            raise self._violation(
                f"use after free: {function} on the communicator of rank {comm.rank} (clique {comm.uid[:8]!r}), "
                f"which ncclComm{'Abort' if how == 'aborted' else 'Destroy'} freed (src/init.cc, commReclaim): "
                "undefined behaviour in NCCL"
            )

    # one thread at a time per device ----------------------------------------------------------------------------
    def _enter_device(self, device: int, function: str) -> None:
        me = threading.get_ident()
        with self._lock:
            holder = self._active.get(device)
            if holder is None or holder[0] == me:
                self._active[device] = (me, (0 if holder is None else holder[1]) + 1)
                return
        raise self._violation(
            f"host threads racing to launch NCCL on same device: {function} on fake GPU {device} from thread "
            f"{threading.current_thread().name} while another thread is inside NCCL there (usage/threadsafety.html; "
            "NCCL 2.26+: src/misc/strongstream.cc, NCCL_LAUNCH_RACE_FATAL)"
        )

    def _leave_device(self, device: int) -> None:
        with self._lock:
            holder = self._active.get(device)
            if holder is not None and holder[0] == threading.get_ident():
                if holder[1] <= 1:
                    del self._active[device]
                else:
                    self._active[device] = (holder[0], holder[1] - 1)

    def _on_device(self, device: int, function: str):
        fake_nccl = self

        class _Guard:
            def __enter__(self) -> None:
                fake_nccl._enter_device(device, function)

            def __exit__(self, *exc: object) -> None:
                fake_nccl._leave_device(device)

        return _Guard()

    # the launch at the group's end ------------------------------------------------------------------------------
    def _launch(self, queued: list[_Queued]) -> int:
        """Enqueue the group's operations: one kernel per stream holding its parts; a part joins its
        operation (the k-th collective of its clique, or the matching send or receive). An operation that
        needs a connection not yet made blocks here until the peers' parts are issued (module docstring)."""
        graphs = {id(q.stream.capture): q.stream.capture for q in queued}
        if len(graphs) > 1:  # src/group.cc, groupLaunch; src/enqueue.cc, ncclPlannerSetCapturingGraph
            raise nccl_error(
                "ncclGroupEnd", INVALID_USAGE,
                "Either none or all communicators in a ncclGroup() can be CUDA graph captured (and one "
                "communicator's streams in a group all uncaptured or all captured by the same graph)",
            )  # fmt: skip
        graph = next(iter(graphs.values()), None)
        if graph is not None:  # recorded into the capture, sent at each replay (fake_graph.py)
            for q in queued:
                graph.append(q.stream, "nccl")
                self._captured_by(graph, q.comm)
            graph.entries.append(fake_graph._Nccl(self, list(queued)))
            return SUCCESS
        by_stream: dict[int, list[tuple[_Queued, Part]]] = {}
        connecting: list[tuple[FakeComm, DeviceOp]] = []
        failed: list[tuple[DeviceOp, str]] = []
        with fake_device.RUN_LOCK:
            for q in queued:
                if q.name in ("send", "recv"):
                    peer = q.args[0]
                    sending = q.name == "send"
                    op, error = self.fabric.point_to_point(
                        q.comm, peer, q.input if sending else None, None if sending else q.output
                    )
                    side = 0 if sending else 1
                    connection: tuple[Any, ...] | None = ("p2p", q.comm.uid, q.comm.rank, peer, q.name)
                else:
                    op, error = self.fabric.collective(q.comm, q.name, q.args)
                    side = q.comm.rank
                    if "scalar" in q.extra:  # (each rank pre-multiplies by its own op's scalar)
                        op.scalars[side] = q.extra["scalar"]
                    connection = ("collective", q.comm.uid, q.name) if q.comm.lazy else None
                part = Part(op, side, self.fake, q.input, q.output)
                part.comm_key = (q.comm.uid, q.comm.rank)
                op.parts[side] = part
                if connection is not None and connection not in self._connected:
                    self._connected.add(connection)
                    connecting.append((q.comm, op))
                    self._charge_connection(q.comm, connection)
                if error is not None:
                    failed.append((op, error))
                by_stream.setdefault(id(q.stream), []).append((q, part))
            kernels = []
            # A communicator's launches run in issue order (module docstring): each kernel first waits for the
            # communicator's previous launch, on whatever stream that went; this group's kernels then are its last.
            lanes = {(q.comm.uid, q.comm.rank) for q in queued}
            before = {key: self._lanes.get(key, []) for key in lanes}
            after: dict[tuple[bytes, int], list[Any]] = {key: [] for key in lanes}
            for items in by_stream.values():
                first, stream = items[0][0], items[0][0].stream
                mine = {(q.comm.uid, q.comm.rank) for q, _ in items}
                for key in mine:
                    for event in before[key]:
                        stream.wait_event(event)
                node = self.fake.log_nccl(
                    "+".join(q.name for q, _ in items), [q.input for q, _ in items if q.input is not None],
                    [q.output for q, _ in items], stream, first.comm, first.extra,
                )  # fmt: skip
                kernels.append(Kernel(stream, node.index, [part for _, part in items]))
                done = self.fake.event()
                done.record(stream)
                for key in mine:
                    after[key].append(done)
            with self._lock:
                self._lanes.update(after)
            for op, error in failed:  # a difference fails the operation: its kernels' streams surface it
                op.fail(error)
                self.fabric.mismatches.append(error)
            fake_device.enqueue(kernels, self.fake.lazy)
        code = SUCCESS
        for comm, op in connecting:
            if comm.blocking:
                self._wait_connected(op)
            elif len(op.parts) < op.size:  # nonblocking: it goes on; comm_get_async_error says when done
                with self._lock:
                    self._in_progress[comm.uid, comm.rank] = op
                code = IN_PROGRESS
        return code

    def replay_group(self, queued: list[_Queued], streams: dict) -> None:
        """A captured group again, as a graph replay launches its NCCL kernels (`streams`: the capture's
        streams -> the replay's). No host thread is inside NCCL for it (the kernels are the graph's nodes), so
        the one-thread-per-device rule does not apply, and no launch thread of NCCL's takes part: its kernels
        are enqueued at once, also for a nonblocking communicator."""
        self._local.replaying = True
        self.group_start()
        try:
            for q in queued:
                self._queue(q.name, q.args, q.comm, streams.get(q.stream, q.stream), q.input, q.output,
                            reduces=q.name in _REDUCING, racing=False, replay=True, **q.extra)  # fmt: skip
        finally:
            try:
                self.group_end()
            finally:
                self._local.replaying = False

    def _launch_on_thread(self, queued: list[_Queued]) -> int:
        """A nonblocking group end: NCCL's thread launches it (module docstring); ncclInProgress now."""
        job = _Deferred(queued)
        delay = self.nonblocking_launch_s

        def run() -> None:
            time.sleep(delay)
            try:
                with self._lock:
                    if job.cancelled:
                        return
                code = self._launch(job.queued)
                if code != SUCCESS:  # (connecting: in progress until the peers' parts come, as before)
                    return
            except NcclError:  # (what the call would have raised: its communicators report it instead)
                with self._lock:
                    for key in job.keys:
                        self._async_errors[key] = 3  # ncclInternalError
            finally:
                job.done.set()
                with self._lock:
                    for key in job.keys:
                        if self._deferred.get(key) is job:
                            del self._deferred[key]

        with self._lock:
            for key in job.keys:
                self._deferred[key] = job
        job.thread = threading.Thread(target=run, name="fake-nccl-launch", daemon=True)
        job.thread.start()
        return IN_PROGRESS

    def _charge_connection(self, comm: FakeComm, connection: tuple[Any, ...]) -> None:
        """A connection made now: a peer's point-to-point buffers (its receive side: fake_nccl_memory.py), or a
        lazily connected communicator's collectives at its first one."""
        if connection[0] == "p2p":
            if connection[-1] == "recv":
                self._charge(comm, self.memory.peer())
        elif not any(c[0] == "collective" and c[1] == comm.uid for c in self._connected - {connection}):
            self._charge(comm, self.memory.collectives(comm.size))

    def _wait_connected(self, op: DeviceOp) -> None:
        """A lazy connection: the group end returns once every peer's part is issued (they connect too)."""
        deadline = time.monotonic() + fake_device.WAIT_TIMEOUT_S
        with fake_device.RUN_LOCK:
            while len(op.parts) < op.size and not op.done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise HangError(
                        f"the group end connecting {op.name} waited {fake_device.WAIT_TIMEOUT_S:g} s on the host "
                        f"for its peers ({op.describe_missing()}): NCCL connects on first use, blocking until the "
                        "peers do (src/transport.cc); a GPU would wait for ever"
                    )
                fake_device.CHANGED.wait(min(remaining, 0.05))


_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})

_C_NAMES = {
    "all_reduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "reduce": "ncclReduce",
    "all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter", "send": "ncclSend", "recv": "ncclRecv",
}  # fmt: skip


def broken_torch_init_rank(num_ranks: int, uid: bytes, rank: int) -> Any:
    """torch.cuda.nccl.init_rank as it behaves on CPython 3.10-3.12 (pytorch#38019): THCPModule_nccl_init_rank
    (torch/csrc/cuda/python_nccl.cpp) parses the id with PyArg_ParseTuple's "s#" without PY_SSIZE_T_CLEAN,
    which those Pythons reject before anything else happens."""
    raise SystemError("PY_SSIZE_T_CLEAN macro must be defined for '#' formats")
