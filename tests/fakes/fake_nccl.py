"""Test double for torch.cuda.nccl: `FakeNccl` (one per simulated process) over a shared `FakeFabric`.

What it checks, in two layers, so that no code path passes against the double while failing on real torch:
- torch.cuda.nccl's own argument checks (torch/csrc/cuda/nccl.cpp), which use the LOCAL list length:
  `reduce` needs 0 <= root < len(inputs) and gives the output to local index `root` only, while NCCL takes
  `root` as the rank that receives; `all_gather` needs output numel == len(inputs) x input numel;
  `reduce_scatter` computes count = input numel / len(inputs) and needs output numel == count. These raise
  RuntimeError at the call, as torch's TORCH_CHECKs do.
- NCCL's: one communicator per input, all of one clique, in increasing rank order (threadpar passes
  members in group order), and every communicator of the clique this process holds in the call (NCCL
  hangs otherwise); NCCL's dtypes; and, once every rank of the clique has issued its part, that the
  buffers are big enough for the CLIQUE's size (torch sized them for the local list: a cross-process
  all_gather or reduce_scatter through them would overrun) and that a reduce's root rank has an output.

Cliques span simulated processes (threadpar.testing runs several in one interpreter): `init_rank` blocks
until the whole clique has joined, like ncclCommInitRank, and a collective is computed once every rank of
the clique has issued it. The thread that issues a part blocks until then (a real launch returns at once
and the device waits); it lets go of its process's launch lock while it waits, so that other groups'
launches in that process go on, as they would on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .fake_device_queue import PendingOp, attach

# torch/csrc/cuda/nccl.cpp, to_nccl_data_type: the dtypes torch maps to an ncclDataType_t (bfloat16 only when
# built with NCCL >= 2.10). torch also maps bool and the float8 types to ncclUint8; the double accepts bool
# only for data movement (threadpar never reduces bool through NCCL: nccl/reduction.py gathers it), stricter than
# torch, which would let NCCL add the bytes.
NCCL_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
INIT_TIMEOUT_S = 5.0
# How long an issued part waits for the rest of its clique (a real device would wait for ever).
OP_TIMEOUT_S = 10.0
SUM = 0
# The root torch.cuda.nccl.broadcast passes to ncclBcast, whatever root its caller gave (see broadcast).
NCCL_BCAST_ROOT = 0


class FakeComm(NamedTuple):
    uid: bytes
    rank: int
    size: int
    thread: str
    process: int  # which FakeNccl (simulated process) created it
    lazy: bool = False  # NCCL >= 2.22 with NCCL_RUNTIME_CONNECT=1: connects peers on first use (see FakeNccl)


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


class FakeFabric:
    """What the NCCLs of all simulated processes share: unique ids, cliques joining, collectives in flight."""

    def __init__(self, op_timeout: float = OP_TIMEOUT_S) -> None:
        self.op_timeout = op_timeout
        self.cond = threading.Condition()
        self._ids = itertools.count()
        self._processes = itertools.count()
        self._joining: dict[bytes, set[int]] = {}
        self.owner: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> process holding that communicator
        self._issued: dict[tuple[bytes, int], int] = {}  # (clique, rank) -> collectives issued so far
        self._ops: dict[tuple[bytes, int], CliqueOp] = {}
        self.id_makers: dict[bytes, str] = {}  # unique id -> the thread that made it

    def new_process(self) -> int:
        return next(self._processes)

    def unique_id(self) -> bytes:
        uid = f"uid-{next(self._ids)}".encode().ljust(128, b"\0")  # NCCL_UNIQUE_ID_BYTES
        with self.cond:
            self.id_makers[uid] = threading.current_thread().name
        return uid

    def join(self, num_ranks: int, uid: bytes, rank: int, process: int) -> None:
        with self.cond:
            joined = self._joining.setdefault(uid, set())
            joined.add(rank)
            self.owner[uid, rank] = process
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(joined) == num_ranks, INIT_TIMEOUT_S):
                raise RuntimeError(
                    f"NCCL Error 6: init of rank {rank}: ranks {sorted(joined)} of {num_ranks} joined"
                )

    def ranks_held_by(self, uid: bytes, process: int) -> list[int]:
        with self.cond:
            return sorted(r for (u, r), p in self.owner.items() if u == uid and p == process)

    def issue(
        self,
        name: str,
        args: tuple,
        comms: list[FakeComm],
        parts: list[Part],
        release: Any,
        lazy: bool = False,
    ) -> None:
        """Add this process's parts of a collective; compute it once every rank has; wait until then.
        `release` is a context manager that lets go of the caller's launch lock while it waits (None: the
        caller keeps it: the real call blocks, connecting to its peers). `lazy`: once every rank has issued
        it, the collective waits on its comm streams until something waits on it (fake_device_queue.py)."""
        uid, size = comms[0].uid, comms[0].size
        with self.cond:
            indices = {self._issued.get((uid, c.rank), 0) for c in comms}
            assert len(indices) == 1, f"{name}: the communicators of one call are at different collectives"
            index = indices.pop()
            for c in comms:
                self._issued[uid, c.rank] = index + 1
            op = self._ops.setdefault((uid, index), CliqueOp(name, args, size))
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
                op.done = True
                del self._ops[uid, index]
                self.cond.notify_all()
        if not op.done:
            # (the launch lock is let go of outside the fabric's lock: launches take them in the other order)
            with release() if release is not None else contextlib.nullcontext(), self.cond:
                finished = self.cond.wait_for(lambda: op.done, self.op_timeout)
            if not finished:
                missing = sorted(set(range(size)) - set(op.parts))
                raise RuntimeError(
                    f"fake NCCL: {name} #{index} on clique {uid[:8]!r}: ranks {missing} never issued it "
                    f"within {self.op_timeout:g} s (on a GPU the kernel would hang)"
                )
        if op.error is not None:
            raise RuntimeError(op.error)


def _check_op(name: str, op: int) -> None:
    """NCCL's built-in reductions are ncclRedOp_t's ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4
    (nccl.h); there is no bitwise op. Any other value (short of a ncclRedOpCreatePreMulSum handle, which
    torch.cuda.nccl never makes) fails with ncclInvalidArgument; torch.cuda.nccl passes `op` through unchanged."""
    if op not in range(5):
        raise RuntimeError(
            f"NCCL Error 4: invalid argument ({name}: ncclRedOp_t {op} is not a reduction NCCL has)"
        )


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
            f"NCCL reduce: rank {root} is the root, but torch.cuda.nccl gave it no output buffer (it "
            "passes the output only at local index root): NCCL would write through a null pointer"
        )
    if op.name == "all_gather":
        short = [r for r, p in enumerate(parts) if p.output.numel() < op.size * count]
        if short:
            return (
                f"NCCL all_gather over {op.size} ranks writes {op.size * count} elements, but ranks {short} "
                "passed smaller outputs (torch.cuda.nccl sizes them by the local inputs): buffer overrun"
            )
    if op.name == "reduce_scatter":
        short = [r for r, p in enumerate(parts) if p.input.numel() < op.size * count]
        if short:
            return (
                f"NCCL reduce_scatter over {op.size} ranks reads {op.size * count} elements, but ranks {short} "
                "passed smaller inputs (torch.cuda.nccl counts by the local inputs): buffer overrun"
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
        for t in inputs:
            t.copy_(source)
    elif op.name == "all_gather":
        gathered = torch.cat([t.view(-1) for t in inputs])
        for p in parts:
            p.output.copy_(gathered)
    elif op.name == "reduce_scatter":
        result = _reduce([t.view(-1)[: op.size * count] for t in inputs], reduce_op).view(op.size, -1)
        for r, p in enumerate(parts):
            p.output.copy_(result[r])
    return None


class FakeNccl:
    """torch.cuda.nccl's functions, with its argument conventions and checks (for one simulated process)."""

    SUM = SUM

    def __init__(self, fake: Any, version: tuple[int, ...], fabric: FakeFabric | None = None) -> None:
        self.fake = fake
        self._version = version
        self.fabric = FakeFabric() if fabric is None else fabric
        self.process = self.fabric.new_process()
        self.fail_next: dict[str, str] = {}  # function name -> message of the error its next call raises
        self.init_calls: list[FakeComm] = []
        # How long ncclCommInitRank works after the clique has joined (a real one takes 0.1-1 s: topology,
        # buffers, connections); tests raise it to widen the window in which the init rule can be broken.
        self.init_seconds = 0.0
        self._initialising: dict[bytes, int] = {}  # clique -> threads of this process inside init_rank
        self._runtime_connect: bool | None = None  # NCCL_RUNTIME_CONNECT as NCCL read it (once per process)
        self._connected: set[tuple[bytes, str]] = set()  # (clique, collective) this process has connected
        self.violations: list[str] = []  # NCCL thread-safety rules broken (also raised to the caller)

    def version(self) -> tuple[int, ...]:
        return self._version

    def unique_id(self) -> bytes:
        return self.fabric.unique_id()

    def init_rank(self, num_ranks: int, uid: bytes, rank: int) -> FakeComm:
        # torch.cuda.nccl.init_rank is ncclCommInitRank (torch/csrc/cuda/python_nccl.cpp), which binds the new
        # communicator to the calling thread's CURRENT device (NCCL docs, usage/communicators.html: each
        # communicator is associated to a fixed rank and CUDA device): without a device guard every rank
        # thread would create its communicator on device 0.
        assert self.fake.guarded_device() is not None, "init_rank called without a device guard (device 0)"
        with self.fake.lock:
            self._initialising[uid] = self._initialising.get(uid, 0) + 1
        try:
            self.fabric.join(num_ranks, uid, rank, self.process)
            if self.init_seconds:
                time.sleep(self.init_seconds)
        finally:
            with self.fake.lock:
                self._initialising[uid] -= 1
        comm = FakeComm(uid, rank, num_ranks, threading.current_thread().name, self.process, self._lazy())
        with self.fake.lock:
            self.init_calls.append(comm)
        return comm

    # collectives (torch.cuda.nccl's signatures) -----------------------------------------------------------------
    def all_reduce(self, inputs, outputs=None, op=SUM, streams=None, comms=None) -> None:
        outputs = inputs if outputs is None else outputs
        _check_op("all_reduce", op)
        self._check("all_reduce", inputs, outputs, streams, comms, reduces=True)
        parts = [Part(i, o) for i, o in zip(inputs, outputs)]
        self._issue(
            "all_reduce", (inputs[0].numel(), inputs[0].dtype, op, None), parts, streams, comms, op=op
        )

    def reduce(self, inputs, output=None, root=0, op=SUM, streams=None, comms=None) -> None:
        if not 0 <= root < len(inputs):  # torch/csrc/cuda/nccl.cpp, reduce: TORCH_CHECK(..., "invalid root")
            raise RuntimeError(
                f"invalid root (torch.cuda.nccl.reduce: root {root} is not an index into {len(inputs)} inputs)"
            )
        output = inputs[root] if output is None else output
        _check_op("reduce", op)
        self._check("reduce", inputs, None, streams, comms, reduces=True)
        if output.numel() != inputs[0].numel() or not output.is_contiguous():
            raise RuntimeError("torch.cuda.nccl.reduce: output must be contiguous, with the inputs' size")
        # torch passes the output only at local index `root`, and `root` to NCCL as the receiving rank.
        parts = [Part(t, output if i == root else None) for i, t in enumerate(inputs)]
        self._issue(
            "reduce", (inputs[0].numel(), inputs[0].dtype, op, root), parts, streams, comms, op=op, root=root
        )

    def broadcast(self, inputs, root=0, streams=None, comms=None) -> None:
        # torch 2.13 checks `root` against the LOCAL list and then drops it: THCPModule_nccl_broadcast
        # (torch/csrc/cuda/python_nccl.cpp) asserts 0 <= root < len(inputs) ("invalid root") and calls
        # torch::cuda::nccl::broadcast(tensors, streams, comms), which has no root parameter
        # (torch/csrc/cuda/nccl.h) and passes root 0 to ncclBcast (torch/csrc/cuda/nccl.cpp, broadcast).
        # So every broadcast through torch.cuda.nccl comes from NCCL rank 0, whatever `root` says.
        if not 0 <= root < len(inputs):
            raise RuntimeError("invalid root")
        self._check("broadcast", inputs, None, streams, comms)
        parts = [Part(t, t) for t in inputs]
        self._issue(
            "broadcast", (inputs[0].numel(), inputs[0].dtype, None, NCCL_BCAST_ROOT), parts, streams, comms,
            root=root,
        )  # fmt: skip

    def all_gather(self, inputs, outputs, streams=None, comms=None) -> None:
        self._check("all_gather", inputs, outputs, streams, comms, out_factor=len(inputs))
        parts = [Part(i, o) for i, o in zip(inputs, outputs)]
        self._issue("all_gather", (inputs[0].numel(), inputs[0].dtype, None, None), parts, streams, comms)

    def reduce_scatter(self, inputs, outputs, op=SUM, streams=None, comms=None) -> None:
        n = len(inputs)
        _check_op("reduce_scatter", op)
        self._check("reduce_scatter", inputs, outputs, streams, comms, reduces=True, out_factor=1 / n)
        count = inputs[0].numel() // n  # torch: the count per rank comes from the LOCAL list length
        parts = [Part(i, o) for i, o in zip(inputs, outputs)]
        self._issue("reduce_scatter", (count, inputs[0].dtype, op, None), parts, streams, comms, op=op)

    # what torch and NCCL check ----------------------------------------------------------------------------------
    def _check(self, name, inputs, outputs, streams, comms, *, reduces=False, out_factor=1.0) -> None:
        message = self.fail_next.pop(name, None)
        if message is not None:
            raise RuntimeError(f"NCCL Error 3: {message}")
        # Sources: torch/csrc/cuda/python_nccl.cpp (unpack_streams, unpack_comms: one stream and one
        # communicator per input), torch/csrc/cuda/nccl.cpp (check_inputs / check_tensor: one dtype, contiguous,
        # equal sizes, output size = input x multiplier; to_nccl_data_type: the dtypes below), NCCL's docs
        # (usage/groups.html: a grouped call must include every communicator this thread drives for the
        # collective, else ncclGroupEnd waits for the missing ones). torch raises RuntimeError; the double
        # raises AssertionError for what threadpar can never pass (a bug in threadpar, not bad user input).
        n = len(inputs)
        assert n > 0 and comms is not None and len(comms) == n, f"{name}: one communicator per input"
        assert all(isinstance(c, FakeComm) for c in comms), f"{name}: not communicators: {comms}"
        assert len({c.uid for c in comms}) == 1, f"{name}: communicators of different cliques"
        ranks = [c.rank for c in comms]
        assert ranks == sorted(set(ranks)), f"{name}: communicators not in increasing rank order: {ranks}"
        held = self.fabric.ranks_held_by(comms[0].uid, self.process)
        assert ranks == held, f"{name}: this process holds ranks {held} of the clique but passed {ranks}"
        assert streams is not None and len(streams) == n, f"{name}: one stream per input"
        assert len({id(s) for s in streams}) == n, f"{name}: two ranks on one stream"
        dtype = inputs[0].dtype
        old = self._version[:2] < (2, 10)
        if dtype not in NCCL_DTYPES - ({torch.bfloat16} if old else set()) and not (
            dtype == torch.bool and not reduces
        ):
            raise RuntimeError(f"Unconvertible NCCL type {dtype}")
        for t in [*inputs, *(outputs or [])]:
            assert t.dtype == dtype and t.is_contiguous(), (
                f"{name}: inputs and outputs must be contiguous {dtype}"
            )
        if not all(t.numel() == inputs[0].numel() for t in inputs):
            raise RuntimeError(f"torch.cuda.nccl.{name}: inputs differ in size")
        if outputs is not None:
            if len(outputs) != n:
                raise RuntimeError(f"torch.cuda.nccl.{name}: one output per input")
            want = inputs[0].numel() * out_factor
            if not all(o.numel() == want for o in outputs):
                raise RuntimeError(
                    f"torch.cuda.nccl.{name}: output numel must be {want:g} ({len(inputs)} local inputs of "
                    f"{inputs[0].numel()}), got {[o.numel() for o in outputs]}"
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

    def _check_not_during_init(self, name: str, uid: bytes) -> None:
        """NCCL's thread-safety rule (docs: usage/threadsafety.html, "Thread Safety"; usage/communicators.html,
        "Using multiple NCCL communicators concurrently"): NCCL operations on independent communicators of one
        device must not be issued in parallel from several threads, and creating a communicator is such an
        operation. Every device of the double is the one CPU device, so: no collective on one clique while a
        thread of this process is inside init_rank of another. (Concurrent inits of the SAME clique from its
        members' threads are how ncclCommInitRank is meant to be used: allowed.)"""
        with self.fake.lock:
            busy = [u for u, n in self._initialising.items() if n and u != uid]
        if busy:
            message = (
                f"NCCL thread-safety: {name} issued on clique {uid[:8]!r} while another thread of this process "
                f"is creating a communicator of clique {busy[0][:8]!r} on the same device"
            )
            self.violations.append(message)
            raise RuntimeError(message)

    def _issue(self, name, args, parts, streams, comms, **extra) -> None:
        self._check_not_during_init(name, comms[0].uid)
        nodes = self.fake.log_nccl(
            name, [p.input for p in parts], [p.output for p in parts], streams, comms, extra
        )
        parts = [p._replace(stream=node.stream, node=node.index) for p, node in zip(parts, nodes)]
        # With runtime connection, the first use of an algorithm connects the peers inside ncclGroupEnd
        # (src/enqueue.cc marks algoNeedConnect when !comm->initAlgoChannels[algorithm]; the group's end
        # sets the connections up, a handshake with the peer processes): the calling thread blocks there,
        # holding whatever it holds. The double keys "algorithm" by collective (an approximation: NCCL picks
        # ring/tree/NVLS per call). Otherwise the call returns at once (the device waits), so the double's
        # wait for the other processes lets go of the launch lock, as a real launch would not be holding it.
        key = (comms[0].uid, name)
        with self.fake.lock:
            connecting = comms[0].lazy and key not in self._connected
            self._connected.add(key)
        release = None if connecting else self.fake.released_launch_lock
        self.fabric.issue(name, args, list(comms), parts, release, lazy=self.fake.lazy)
