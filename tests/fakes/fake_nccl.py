"""Test double of NCCL's C API (nccl.h): `FakeNccl` (one per simulated process) over a shared `FakeFabric`.

It stands where threadpar.comm.nccl.library.NcclLibrary stands (the NcclApi seam: one method per C function,
tensors for buffers), so every line of the backend above the binding runs against it. What it enforces, each
rule with the NCCL source or document it mirrors:
- Communicators: ncclCommInitRank blocks until every rank of the unique id has joined (nccl.h); one rank per
  device in a communicator ("Duplicate GPU detected", ncclInvalidUsage: src/init.cc); a freed or aborted
  communicator is refused (src/misc/argcheck.cc, CommCheck: ncclInvalidArgument).
- Groups: ncclGroupStart/End nest per thread (src/group.cc: ncclGroupDepth is thread-local), an end without a
  start is ncclInvalidUsage (group.cc, ncclGroupEndInternal), and the operations of a group are launched at
  its outermost end, not before (usage/groups.html); an operation outside a group is a group of its own.
- Threads: operations on one device's communicators must not be issued from two threads at the same time,
  creating a communicator included (usage/threadsafety.html; usage/communicators.html, "Using multiple NCCL
  communicators concurrently").
- Collectives: every rank of a communicator issues the same collective with the same count, type, op and
  root, in the same order (else NCCL hangs or corrupts: the double says so); the buffers are large enough
  for the communicator's size (ncclAllGather's recvbuff holds nranks x sendcount, ncclReduceScatter's
  sendbuff nranks x recvcount: nccl.h); the root of ncclReduce has a recvbuff; in-place only as
  usage/inplace.html defines it; ncclRedOp_t without bitwise ops; ncclAvg computed as NCCL computes it.
- Point to point: ncclSend/ncclRecv match per (communicator, peer) in issue order, with the same count and
  type (usage/p2p.html); a rank may send to itself inside a group.
- Failures: ncclCommAbort ends the communicator's pending operations with an error (nccl.h); an
  asynchronous error is what ncclCommGetAsyncError reports (`async_error_code`).
It also models the one torch.cuda.nccl fact threadpar must never meet again: `init_rank` raises SystemError
on CPython 3.10-3.12 (pytorch#38019; tests/conftest.py installs `broken_torch_init_rank`).

Cliques span simulated processes (threadpar.testing runs several in one interpreter): a collective is
computed once every rank of the clique has issued it. The thread that issues a part waits until then (a real
launch returns at once and the device waits); it lets go of its process's launch lock while it waits, so
that other groups' launches in that process go on, as they would on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from threadpar.comm.nccl.library import RESULT_NAMES
from threadpar.errors import NcclError

from .fake_device_queue import PendingOp, attach

# The dtypes that have an ncclDataType_t (nccl.h); bool travels as uint8 (library.data_type), for data
# movement only (threadpar never reduces bool through NCCL: nccl/reduction.py gathers it).
NCCL_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
INIT_TIMEOUT_S = 5.0
# How long an issued part waits for the rest of its clique (a real device would wait for ever).
OP_TIMEOUT_S = 10.0
# ncclResult_t (nccl.h)
INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 4, 5, 6


def nccl_error(function: str, code: int, message: str) -> NcclError:
    """The error the binding raises for a failed call (threadpar.comm.nccl.library.NcclLibrary._error)."""
    return NcclError(f"{function} failed: {RESULT_NAMES[code]} ({message})")


class FakeComm(NamedTuple):
    uid: bytes
    rank: int
    size: int
    thread: str
    process: int  # which FakeNccl (simulated process) created it
    lazy: bool = False  # NCCL >= 2.22 with NCCL_RUNTIME_CONNECT=1: connects peers on first use (see FakeNccl)
    device: int = 0  # the (fake) CUDA device it is bound to


class Part(NamedTuple):
    """One rank's share of a collective: its input, and where NCCL writes its result (None: nowhere);
    the comm stream it was launched on and its node there (for lazy mode)."""

    input: torch.Tensor
    output: torch.Tensor | None
    stream: Any = None
    node: int = -1


@dataclass
class CliqueOp:
    """The k-th collective of one clique: the parts issued so far, by NCCL rank."""

    name: str
    args: tuple  # what every rank must agree on: (count, dtype, op, root)
    size: int
    parts: dict[int, Part] = field(default_factory=dict)
    done: bool = False
    error: str | None = None
    index: int = 0
    uid: bytes = b""


@dataclass
class P2pOp:
    """One ncclSend matched (or waiting to be matched) with one ncclRecv of the same peer pair."""

    src: int
    dst: int
    send: torch.Tensor | None = None
    recv: torch.Tensor | None = None
    done: bool = False
    error: str | None = None
    uid: bytes = b""
    name: str = "send/recv"


class FakeFabric:
    """What the NCCLs of all simulated processes share: unique ids, cliques joining, collectives in flight."""

    def __init__(self, op_timeout: float = OP_TIMEOUT_S) -> None:
        self.op_timeout = op_timeout
        self.cond = threading.Condition()
        self._ids = itertools.count()
        self._processes = itertools.count()
        self._joining: dict[bytes, set[int]] = {}
        self._failed: set[bytes] = set()  # cliques whose init failed
        self._devices: dict[tuple[bytes, int, int], int] = {}  # (clique, process, device) -> its rank
        self.owner: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> process holding that communicator
        self._issued: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> collectives issued so far
        self._ops: dict[tuple[bytes, int], CliqueOp] = {}
        # (clique, src, dst) -> sends and receives not yet matched, in issue order
        self._sends: dict[tuple[bytes, int, int], deque[P2pOp]] = {}
        self._recvs: dict[tuple[bytes, int, int], deque[P2pOp]] = {}
        self.freed: set[tuple[bytes, int]] = set()  # (clique, rank) destroyed or aborted
        self.id_makers: dict[bytes, str] = {}  # unique id -> the thread that made it

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
            if not self.cond.wait_for(
                lambda: len(joined) == num_ranks or uid in self._failed, INIT_TIMEOUT_S
            ):
                raise nccl_error(
                    "ncclCommInitRank", REMOTE_ERROR,
                    f"init of rank {rank}: ranks {sorted(joined)} of {num_ranks} joined within {INIT_TIMEOUT_S:g} s "
                    "(the double's bound; NCCL waits for ever)",
                )  # fmt: skip
            if uid in self._failed:
                raise nccl_error(
                    "ncclCommInitRank", INVALID_USAGE, "Duplicate GPU detected (another rank's init)"
                )

    def ranks_held_by(self, uid: bytes, process: int) -> list[int]:
        with self.cond:
            return sorted(r for (u, r), p in self.owner.items() if u == uid and p == process)

    # collectives: post every part of a group, then wait for all ---------------------------------------------
    def post(
        self, name: str, args: tuple, comms: list[FakeComm], parts: list[Part], lazy: bool = False
    ) -> CliqueOp:
        """Add these parts (this process's, of one collective of one clique); compute it once every rank
        has. `lazy`: once complete, the collective waits on its comm streams until something waits on it."""
        uid, size = comms[0].uid, comms[0].size
        with self.cond:
            indices = {self._issued.get((uid, c.rank), 0) for c in comms}
            assert len(indices) == 1, f"{name}: the communicators of one call are at different collectives"
            index = indices.pop()
            for c in comms:
                self._issued[uid, c.rank] = index + 1
            op = self._ops.setdefault((uid, index), CliqueOp(name, args, size, index=index, uid=uid))
            if (op.name, op.args) != (name, args):
                op.error = (
                    f"NCCL collectives differ on clique {uid[:8]!r} at its collective #{index}: "
                    f"{op.name}{op.args} and {name}{args} (NCCL would hang or corrupt data)"
                )
            for c, part in zip(comms, parts):
                op.parts[c.rank] = part
            if op.error is None and len(op.parts) == size:
                op.error = _compute(op, run=not lazy)
                if op.error is None and lazy:
                    _defer(op)
            if len(op.parts) == size or op.error is not None:
                self._finish(op)
        return op

    def _finish(self, op: CliqueOp | P2pOp) -> None:
        op.done = True
        if isinstance(op, CliqueOp):
            self._ops.pop((op.uid, op.index), None)
        self.cond.notify_all()

    # point to point ---------------------------------------------------------------------------------------------
    def post_send(self, comm: FakeComm, peer: int, tensor: torch.Tensor) -> P2pOp:
        return self._post_p2p(comm.uid, comm.rank, peer, send=tensor)

    def post_recv(self, comm: FakeComm, peer: int, tensor: torch.Tensor) -> P2pOp:
        return self._post_p2p(comm.uid, peer, comm.rank, recv=tensor)

    def _post_p2p(self, uid: bytes, src: int, dst: int, send=None, recv=None) -> P2pOp:
        """usage/p2p.html: each ncclRecv from `src` matches the oldest unmatched ncclSend of `src` to this
        rank on this communicator, and the two must agree on count and type."""
        key = (uid, src, dst)
        with self.cond:
            mine, theirs = (self._sends, self._recvs) if send is not None else (self._recvs, self._sends)
            waiting = theirs.get(key)
            if waiting:
                op = waiting.popleft()
                if send is not None:
                    op.send = send
                else:
                    op.recv = recv
                assert op.send is not None and op.recv is not None
                if (op.send.numel(), op.send.dtype) != (op.recv.numel(), op.recv.dtype):
                    op.error = (
                        f"NCCL send/recv {src} -> {dst}: the send has {op.send.numel()} x {op.send.dtype}, the "
                        f"receive {op.recv.numel()} x {op.recv.dtype} (usage/p2p.html: they must match)"
                    )
                else:
                    op.recv.copy_(op.send)
                self._finish(op)
                return op
            op = P2pOp(src, dst, send, recv, uid=uid)
            mine.setdefault(key, deque()).append(op)
            return op

    # waiting, aborting ------------------------------------------------------------------------------------------
    def wait(self, ops: Sequence[CliqueOp | P2pOp], release: Any) -> None:
        """Until every op is done (`release`: lets go of the caller's launch lock meanwhile, or None)."""
        if all(op.done for op in ops):
            self._raise_errors(ops)
            return
        # (the launch lock is let go of outside the fabric's lock: launches take them in the other order)
        with release() if release is not None else contextlib.nullcontext(), self.cond:
            finished = self.cond.wait_for(lambda: all(op.done for op in ops), self.op_timeout)
        if not finished:
            late = next(op for op in ops if not op.done)
            if isinstance(late, CliqueOp):
                missing = sorted(set(range(late.size)) - set(late.parts))
                what = f"{late.name} #{late.index}: ranks {missing} never issued it"
            else:
                what = f"send/recv {late.src} -> {late.dst}: the {'recv' if late.recv is None else 'send'} never came"
            raise RuntimeError(
                f"fake NCCL: {what} within {self.op_timeout:g} s (on a GPU the kernel would hang)"
            )
        self._raise_errors(ops)

    @staticmethod
    def _raise_errors(ops: Sequence[CliqueOp | P2pOp]) -> None:
        for op in ops:
            if op.error is not None:
                raise RuntimeError(op.error)

    def abort(self, comm: FakeComm) -> None:
        """ncclCommAbort: the communicator's pending operations end with an error (nccl.h), it is freed."""
        with self.cond:
            self.freed.add((comm.uid, comm.rank))
            message = f"NCCL communicator of rank {comm.rank} was aborted (ncclCommAbort) with this operation pending"
            for op in list(self._ops.values()):
                if op.uid == comm.uid and not op.done:
                    op.error = op.error or message
                    self._finish(op)
            for queues in (self._sends, self._recvs):
                for (uid, src, dst), waiting in queues.items():
                    if uid == comm.uid and comm.rank in (src, dst):
                        for op in waiting:
                            op.error = message
                            self._finish(op)
                        waiting.clear()

    def check_usable(self, comm: FakeComm, function: str) -> None:
        with self.cond:
            freed = (comm.uid, comm.rank) in self.freed
        if freed:
            # src/misc/argcheck.cc, CommCheck: a freed communicator's magic no longer matches
            raise nccl_error(function, INVALID_ARGUMENT, "the communicator was destroyed or aborted")


def _check_op(name: str, op: int) -> None:
    """NCCL's built-in reductions are ncclRedOp_t's ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4
    (nccl.h); there is no bitwise op. Any other value (short of a ncclRedOpCreatePreMulSum handle, which
    threadpar never makes) fails with ncclInvalidArgument (src/enqueue.cc, hostToDevRedOp / ArgsCheck)."""
    if op not in range(5):
        raise nccl_error(name, INVALID_ARGUMENT, f"ncclRedOp_t {op} is not a reduction NCCL has")


def _reduce(inputs: list[torch.Tensor], op: int) -> torch.Tensor:
    if op == 4 and inputs[0].dtype.is_floating_point:
        return _pre_mul_sum(inputs)
    result = inputs[0].clone()
    for t in inputs[1:]:
        if op in (0, 4):
            result.add_(t)
        elif op == 1:
            result.mul_(t)
        else:
            (torch.maximum if op == 2 else torch.minimum)(result, t, out=result)
    if op == 4:
        # ncclAvg on integers: hostToDevRedOp (src/enqueue.cc) picks ncclDevSumPostDiv, FuncSumPostDiv
        # (src/device/reduce_kernel.h) divides the sum by nRanks with C's integer division (towards zero).
        return result.div_(len(inputs), rounding_mode="trunc")
    return result


def _pre_mul_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """ncclAvg on floating types, as NCCL computes it: hostToDevRedOp (src/enqueue.cc) turns it into
    ncclDevPreMulSum with the scalar 1/nRanks held IN THE DATA TYPE (f16 = __float2half(float(1.0/n)),
    bf16 = __float2bfloat16(float(1.0/n)), f32 = float(1.0/n), f64 = 1.0/n), and FuncPreMulSum
    (src/device/reduce_kernel.h) multiplies every input by it (rounded to the type) before the sum, which
    adds in the type. So for n not a power of two the fp16/bf16 average carries the rounding of 1/n: a
    bias of the same sign on every element (1/3 in bf16 is 0.333984375, +0.2%). (The sum runs in rank order
    here; NCCL's ring adds in ring order per chunk: a rounding-level difference the double does not model.)"""
    dtype, n = inputs[0].dtype, len(inputs)
    exact = 1.0 / n
    single = float(torch.tensor(exact, dtype=torch.float32))  # float(1.0/n)
    scale = torch.tensor(exact if dtype == torch.float64 else single, dtype=torch.float64)
    scale = scale.to(dtype)  # float -> half/bfloat16 rounds to nearest, as __float2half/__float2bfloat16
    result = inputs[0] * scale
    for t in inputs[1:]:
        result.add_(t * scale)
    return result


def _defer(op: CliqueOp) -> None:
    """Lazy mode: leave the checked collective on its comm streams, to run when something waits on it."""
    parts = [op.parts[r] for r in range(op.size)]
    pending = PendingOp(
        op.name,
        lambda: _compute(op),
        reads=[p.input for p in parts],
        writes=[p.output for p in parts if p.output is not None and p.output is not p.input],
    )
    attach(pending, [(p.stream, p.node) for p in parts])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _in_place_offset(op: CliqueOp, parts: list[Part], count: int) -> str | None:
    """NCCL's in-place rule for the two collectives whose buffers differ in size (docs, usage/inplace.html,
    "In-place Operations"): ncclAllGather(data + rank * sendcount, data, ...) and ncclReduceScatter(data,
    data + rank * recvcount, ...) are in place; any other overlap of the send and receive buffers is not
    an operation NCCL defines (it reads bytes it has already overwritten, or the reverse)."""
    for rank, p in enumerate(parts):
        if p.output is None or not _overlap(p.input, p.output):
            continue
        whole, piece = (p.output, p.input) if op.name == "all_gather" else (p.input, p.output)
        want = whole.data_ptr() + rank * count * whole.element_size()
        if piece.data_ptr() != want:
            offset = (piece.data_ptr() - whole.data_ptr()) // whole.element_size()
            return (
                f"NCCL {op.name}: rank {rank}'s send and receive buffers overlap, but its "
                f"{'input' if op.name == 'all_gather' else 'output'} starts at element {offset} of the "
                f"{'output' if op.name == 'all_gather' else 'input'}, not at rank * count = {rank * count} (NCCL's "
                "in-place rule, usage/inplace.html): NCCL would read data it already overwrote"
            )
    return None


def _compute(op: CliqueOp, run: bool = True) -> str | None:
    """Check a collective whose parts have all been issued and (`run`) compute it; returns what NCCL would
    get wrong, if anything."""
    parts = [op.parts[r] for r in range(op.size)]  # by NCCL rank
    count, _dtype, reduce_op, root = op.args
    if op.name in ("all_gather", "reduce_scatter"):
        error = _in_place_offset(op, parts, count)
        if error is not None:
            return error
    if not run:
        return _sizes(op, parts, count, root)
    return _sizes(op, parts, count, root) or _execute(op, parts, count, reduce_op, root)


def _sizes(op: CliqueOp, parts: list[Part], count: int, root: Any) -> str | None:
    if op.name == "reduce" and parts[root].output is None:
        return (
            f"NCCL reduce: rank {root} is the root, but passed no recvbuff: NCCL would write through a null "
            "pointer (nccl.h: the root's recvbuff receives the result)"
        )
    if op.name == "all_gather":
        short = [r for r, p in enumerate(parts) if p.output.numel() < op.size * count]
        if short:
            return (
                f"NCCL all_gather over {op.size} ranks writes {op.size * count} elements, but ranks {short} "
                "passed smaller outputs (nccl.h: recvbuff holds nranks x sendcount): buffer overrun"
            )
    if op.name == "reduce_scatter":
        short = [r for r, p in enumerate(parts) if p.input.numel() < op.size * count]
        if short:
            return (
                f"NCCL reduce_scatter over {op.size} ranks reads {op.size * count} elements, but ranks {short} "
                "passed smaller inputs (nccl.h: sendbuff holds nranks x recvcount): buffer overrun"
            )
    return None


def _execute(op: CliqueOp, parts: list[Part], count: int, reduce_op: Any, root: Any) -> str | None:
    inputs = [p.input for p in parts]
    if op.name == "all_reduce":
        result = _reduce(inputs, reduce_op)
        for p in parts:
            p.output.copy_(result)
    elif op.name == "reduce":
        parts[root].output.copy_(_reduce(inputs, reduce_op))
    elif op.name == "broadcast":
        source = inputs[root].clone()
        for p in parts:
            p.output.copy_(source)
    elif op.name == "all_gather":
        gathered = torch.cat([t.view(-1) for t in inputs])
        for p in parts:
            p.output.copy_(gathered)
    elif op.name == "reduce_scatter":
        result = _reduce([t.view(-1)[: op.size * count] for t in inputs], reduce_op).view(op.size, -1)
        for r, p in enumerate(parts):
            p.output.copy_(result[r])
    return None


class _Queued(NamedTuple):
    """An operation issued inside a group, launched at the group's end."""

    name: str
    args: tuple  # for collectives: (count, dtype, op, root); for p2p: (peer,)
    comm: FakeComm
    stream: Any
    part: Part
    extra: dict


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
        # buffers, connections); tests raise it to widen the window in which the init rule can be broken.
        self.init_seconds = 0.0
        self._initialising: dict[int, set[bytes]] = {}  # device -> cliques being created on it, this process
        self._driving: dict[int, int] = {}  # device -> the thread whose open group holds operations on it
        self._runtime_connect: bool | None = None  # NCCL_RUNTIME_CONNECT as NCCL read it (once per process)
        self._connected: set[tuple[bytes, str]] = set()  # (clique, collective) this process has connected
        self._local = threading.local()  # this thread's group: depth and queued operations
        self.violations: list[str] = []  # NCCL thread-safety rules broken (also raised to the caller)

    # version, errors, communicators -----------------------------------------------------------------------------
    def version(self) -> tuple[int, int, int]:
        return self._version  # type: ignore[return-value]

    def error_string(self, code: int) -> str:
        return {0: "no error", 4: "invalid argument", 5: "invalid usage", 6: "remote process exited or there "
                "was a network error"}.get(code, "unhandled error")  # fmt: skip

    def get_unique_id(self) -> bytes:
        self._fail_if_told("ncclGetUniqueId")
        return self.fabric.unique_id()

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, device: int) -> FakeComm:
        self._fail_if_told("ncclCommInitRank")
        if (
            not 0 <= rank < nranks
        ):  # src/init.cc, ncclCommInitRankDev: "rank %d nranks %d" -> ncclInvalidArgument
            raise nccl_error("ncclCommInitRank", INVALID_ARGUMENT, f"rank {rank} is not in [0, {nranks})")
        with self.fake.lock:
            self._initialising.setdefault(device, set()).add(unique_id)
        try:
            self.fabric.join(nranks, unique_id, rank, self.process, device)
            if self.init_seconds:
                time.sleep(self.init_seconds)
        finally:
            with self.fake.lock:
                self._initialising[device].discard(unique_id)
        comm = FakeComm(
            unique_id, rank, nranks, threading.current_thread().name, self.process, self._lazy(), device
        )
        with self.fake.lock:
            self.init_calls.append(comm)
        return comm

    def comm_init_all(self, devices: Sequence[int]) -> list[FakeComm]:
        """ncclCommInitAll (src/init.cc): a unique id of its own, then every rank joined from this one thread
        (NCCL runs the inits inside a group); duplicate devices fail as in comm_init_rank."""
        self._fail_if_told("ncclCommInitAll")
        uid, n = self.fabric.unique_id(), len(devices)
        comms: list[Any] = [None] * n
        errors: list[BaseException] = []

        def join(i: int) -> None:
            try:
                comms[i] = self.comm_init_rank(n, uid, i, devices[i])
            except BaseException as error:
                errors.append(error)

        joiners = [threading.Thread(target=join, args=(i,)) for i in range(n)]
        for t in joiners:
            t.start()
        for t in joiners:
            t.join()
        if errors:
            raise errors[0]
        return comms

    def comm_destroy(self, comm: FakeComm) -> None:
        self.fabric.check_usable(comm, "ncclCommDestroy")
        self.fabric.abort(comm)  # (nothing may be pending on a communicator that is destroyed: freed alike)
        with self.fake.lock:
            self.destroyed.append(comm)

    def comm_abort(self, comm: FakeComm) -> None:
        self.fabric.check_usable(comm, "ncclCommAbort")
        self.fabric.abort(comm)
        with self.fake.lock:
            self.aborted.append(comm)

    def comm_get_async_error(self, comm: FakeComm) -> int:
        self.fabric.check_usable(comm, "ncclCommGetAsyncError")
        return self.async_error_code

    # groups -----------------------------------------------------------------------------------------------------
    def _group(self) -> tuple[int, list[_Queued]]:
        local = self._local
        if not hasattr(local, "depth"):
            local.depth, local.queued = 0, []
        return local.depth, local.queued

    def group_start(self) -> None:
        self._enter_group()

    def group_end(self) -> None:
        self._leave_group()

    def _enter_group(self) -> None:
        depth, _ = self._group()
        self._local.depth = depth + 1

    def _leave_group(self) -> None:
        depth, queued = self._group()
        if depth == 0:  # src/group.cc, ncclGroupEndInternal: "ncclGroupEnd: not in a group call."
            raise nccl_error("ncclGroupEnd", INVALID_USAGE, "not in a group call (no ncclGroupStart)")
        self._local.depth = depth - 1
        if depth > 1:
            return
        self._local.queued = []
        try:
            posted, connecting = self._post(queued)
        finally:
            self._stop_driving(queued)  # (the host's part is done: a real group end returns here)
        # Unless connecting, the launch returns at once (the device waits), so the double's wait for the
        # other processes lets go of the launch lock, as a real launch would not be holding it.
        self.fabric.wait(posted, None if connecting else self.fake.released_launch_lock)

    # collectives and point to point (the C functions' arguments, tensors for buffers) ---------------------------
    def all_reduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: FakeComm, stream: Any
    ) -> None:
        _check_op("ncclAllReduce", op)
        self._queue("all_reduce", (send.numel(), send.dtype, op, None), comm, stream, Part(send, recv), recv=recv,
                    reduces=True, op=op)  # fmt: skip

    def broadcast(
        self, send: torch.Tensor, recv: torch.Tensor, root: int, comm: FakeComm, stream: Any
    ) -> None:
        self._check_root("ncclBroadcast", root, comm)
        self._queue("broadcast", (recv.numel(), recv.dtype, None, root), comm, stream, Part(send, recv), recv=recv,
                    root=root)  # fmt: skip

    def reduce(
        self, send: torch.Tensor, recv: torch.Tensor | None, root: int, op: int, comm: FakeComm, stream: Any
    ) -> None:
        _check_op("ncclReduce", op)
        self._check_root("ncclReduce", root, comm)
        self._queue("reduce", (send.numel(), send.dtype, op, root), comm, stream, Part(send, recv), recv=recv,
                    reduces=True, op=op, root=root)  # fmt: skip

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor, comm: FakeComm, stream: Any) -> None:
        self._queue(
            "all_gather", (send.numel(), send.dtype, None, None), comm, stream, Part(send, recv), recv=recv
        )

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: FakeComm, stream: Any
    ) -> None:
        _check_op("ncclReduceScatter", op)
        self._queue("reduce_scatter", (recv.numel(), recv.dtype, op, None), comm, stream, Part(send, recv),
                    recv=recv, reduces=True, op=op)  # fmt: skip

    def send(self, tensor: torch.Tensor, peer: int, comm: FakeComm, stream: Any) -> None:
        self._check_root("ncclSend", peer, comm)
        self._queue("send", (peer,), comm, stream, Part(tensor, None), peer=peer)

    def recv(self, tensor: torch.Tensor, peer: int, comm: FakeComm, stream: Any) -> None:
        self._check_root("ncclRecv", peer, comm)
        self._queue("recv", (peer,), comm, stream, Part(tensor, tensor), recv=tensor, peer=peer)

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

    def _queue(self, name, args, comm, stream, part, *, recv=None, reduces=False, **extra) -> None:
        function = _C_NAMES[name]
        self._fail_if_told(function)
        self.fabric.check_usable(comm, function)
        assert isinstance(comm, FakeComm), f"{function}: not a communicator: {comm!r}"
        assert stream is not None, f"{function}: no stream"
        self._check_buffers(function, part.input, recv, reduces)
        self._check_not_during_init(function, comm)
        self._drive(function, comm.device)
        self._enter_group()  # (an operation outside a group is a group of its own: src/collectives.cc)
        _, queued = self._group()
        queued.append(_Queued(name, args, comm, stream, part, extra))
        self._leave_group()

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

    def _lazy(self) -> bool:
        """Whether a communicator made now connects its peers lazily: src/init.cc sets comm->runtimeConn from
        ncclParamRuntimeConnect() (NCCL_PARAM(RuntimeConnect, "RUNTIME_CONNECT", 1), NCCL >= 2.22), a value
        NCCL reads from the environment once per process and caches, hence read once here."""
        with self.fake.lock:
            if self._runtime_connect is None:
                self._runtime_connect = self._version[:2] >= (2, 22) and os.environ.get(
                    "NCCL_RUNTIME_CONNECT", "1"
                ).strip() not in ("0", "")
            return self._runtime_connect

    def _violation(self, message: str) -> None:
        with self.fake.lock:
            self.violations.append(message)
        raise RuntimeError(message)

    def _check_not_during_init(self, function: str, comm: FakeComm) -> None:
        """NCCL's thread-safety rule (docs: usage/threadsafety.html, "Thread Safety"; usage/communicators.html,
        "Using multiple NCCL communicators concurrently"): operations on independent communicators of one
        device must not be issued in parallel from several threads, and creating a communicator is such an
        operation: no operation on a device while another thread of this process creates a communicator of
        another clique there. (Concurrent inits of the SAME clique from its members' threads are how
        ncclCommInitRank is meant to be used.)"""
        with self.fake.lock:
            busy = [u for u in self._initialising.get(comm.device, ()) if u != comm.uid]
        if busy:
            self._violation(
                f"NCCL thread-safety: {function} issued on clique {comm.uid[:8]!r} while another thread of this "
                f"process is creating a communicator of clique {busy[0][:8]!r} on device {comm.device}"
            )

    def _drive(self, function: str, device: int) -> None:
        """The same rule for operations: a device's communicators are driven by one thread at a time; this
        thread holds the device from its first operation there until its group ends."""
        me = threading.get_ident()
        with self.fake.lock:
            holder = self._driving.setdefault(device, me)
        if holder != me:
            self._violation(
                f"NCCL thread-safety: {function} on device {device} from thread {threading.current_thread().name} "
                "while another thread's group holds operations on that device (usage/threadsafety.html)"
            )

    def _stop_driving(self, queued: list[_Queued]) -> None:
        me = threading.get_ident()
        with self.fake.lock:
            for q in queued:
                if self._driving.get(q.comm.device) == me:
                    del self._driving[q.comm.device]

    # the launch at the group's end ------------------------------------------------------------------------------
    def _post(self, queued: list[_Queued]) -> tuple[list[Any], bool]:
        """Enqueue every queued operation on its stream and post it to the fabric (the caller waits for all):
        the k-th collective of each communicator in the group forms one call per clique (its local parts).
        Returns the posted operations, and whether the group connects peers (it then blocks)."""
        collectives: dict[tuple[bytes, int], list[_Queued]] = {}
        counts: dict[tuple[bytes, int], int] = {}
        p2p: list[_Queued] = []
        for q in queued:
            if q.name in ("send", "recv"):
                p2p.append(q)
                continue
            k = counts.get((q.comm.uid, q.comm.rank), 0)
            counts[q.comm.uid, q.comm.rank] = k + 1
            collectives.setdefault((q.comm.uid, k), []).append(q)
        posted: list[Any] = []
        connecting = False
        for group in collectives.values():
            group.sort(key=lambda q: q.comm.rank)
            first = group[0]
            different = [q for q in group if (q.name, q.args) != (first.name, first.args)]
            if different:
                raise RuntimeError(
                    f"NCCL collectives differ within one group on clique {first.comm.uid[:8]!r}: {first.name}"
                    f"{first.args} and {different[0].name}{different[0].args} (NCCL would hang or corrupt data)"
                )
            parts, comms = self._log([q.part for q in group], group)
            # With runtime connection, the first use of an algorithm connects the peers inside ncclGroupEnd
            # (src/enqueue.cc marks algoNeedConnect when !comm->initAlgoChannels[algorithm]; the group's end
            # sets the connections up, a handshake with the peer processes): the calling thread blocks there,
            # holding whatever it holds. The double keys "algorithm" by collective (an approximation: NCCL
            # picks ring/tree/NVLS per call).
            key = (first.comm.uid, first.name)
            with self.fake.lock:
                connecting |= first.comm.lazy and key not in self._connected
                self._connected.add(key)
            posted.append(self.fabric.post(first.name, first.args, comms, parts, lazy=self.fake.lazy))
        for q in sorted(p2p, key=lambda q: q.name != "send"):  # sends first: a rank may send to itself
            self._log([q.part], [q])
            peer = q.args[0]
            if q.name == "send":
                posted.append(self.fabric.post_send(q.comm, peer, q.part.input))
            else:
                posted.append(self.fabric.post_recv(q.comm, peer, q.part.input))
        return posted, connecting

    def _log(self, parts: list[Part], group: list[_Queued]) -> tuple[list[Part], list[FakeComm]]:
        first = group[0]
        outputs = [p.output for p in parts]
        nodes = self.fake.log_nccl(
            first.name, [p.input for p in parts], outputs, [q.stream for q in group], [q.comm for q in group],
            first.extra,
        )  # fmt: skip
        placed = [p._replace(stream=node.stream, node=node.index) for p, node in zip(parts, nodes)]
        return placed, [q.comm for q in group]


_C_NAMES = {
    "all_reduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "reduce": "ncclReduce",
    "all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter", "send": "ncclSend", "recv": "ncclRecv",
}  # fmt: skip


def broken_torch_init_rank(num_ranks: int, uid: bytes, rank: int) -> Any:
    """torch.cuda.nccl.init_rank as it behaves on CPython 3.10-3.12 (pytorch#38019): THCPModule_nccl_init_rank
    (torch/csrc/cuda/python_nccl.cpp) parses the id with PyArg_ParseTuple's "s#" without PY_SSIZE_T_CLEAN,
    which those Pythons reject before anything else happens."""
    raise SystemError("PY_SSIZE_T_CLEAN macro must be defined for '#' formats")
