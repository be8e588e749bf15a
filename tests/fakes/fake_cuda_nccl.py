"""Test double for torch.cuda.nccl, CUDA streams and events: `FakeCuda` stands in for threadpar's CudaApi.

A small simulation rather than a mock:
- Streams keep what was enqueued on them; an event remembers where it was last recorded; a wait enqueues
  an edge to that point. `fake.ordered(a, b)` answers "would CUDA run a before b?" from stream order and
  event edges, so tests check ordering semantics rather than call sequences.
- `FakeNccl` checks what NCCL and torch.cuda.nccl check (one tensor, stream and communicator per rank of
  one clique, in rank order; NCCL's dtypes; sizes), also checks that the calling thread holds the launch
  lock, computes the results on the CPU tensors, and logs every call.
- `init_rank` behaves like ncclCommInitRank: it returns only once every rank of the clique has called it,
  so communicators created one after another from one thread fail (after a short timeout).
- The device can hang (events recorded while hung stay incomplete until `resume()`), the next call of an
  NCCL function can fail, and an asynchronous NCCL error can be set.
Devices are CPU devices, and every thread has its own default stream: the general case of ranks that
compute on their own streams (on a real GPU, threads share the device's default stream unless told not to).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from threadpar.comm.cuda_api import CliquePool
from threadpar.errors import RankFailedError
from threadpar.runtime.launch import _Launch
from threadpar.runtime.world import World
from threadpar.topology import Layout

NCCL_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
INIT_TIMEOUT_S = 5.0


class Node(NamedTuple):
    """A position in a stream: the op at `index`."""

    stream: FakeStream
    index: int


class FakeStream:
    def __init__(self, fake: FakeCuda, name: str, device: torch.device, priority: int = 0) -> None:
        self.fake, self.name, self.device, self.priority = fake, name, device, priority
        self.ops: list[tuple] = []

    def _append(self, *op: Any) -> Node:
        with self.fake.lock:
            self.ops.append(op)
            return Node(self, len(self.ops) - 1)

    def wait_event(self, event: FakeEvent) -> None:
        self._append("wait", event, event.node)  # waits for the event's latest record, as CUDA does

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.node: Node | None = None  # where it was last recorded (None: never: waiting on it is a no-op)
        self.complete = True

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current_stream(torch.device("cpu"))
        self.node = stream._append("record", self)
        self.complete = not self.fake.hung

    def query(self) -> bool:
        if self.fake.device_error is not None:
            raise RuntimeError(f"CUDA error: {self.fake.device_error}")
        return self.complete or not self.fake.hung


class FakeComm(NamedTuple):
    uid: bytes
    rank: int
    size: int
    thread: str


class OwnedLock:
    """A lock that knows which thread holds it, so the fake can check NCCL is called under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self.owner = threading.get_ident()
        return self

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self._lock.release()

    def held_by_me(self) -> bool:
        return self.owner == threading.get_ident()


@dataclass
class FakeCall:
    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    streams: list[FakeStream]
    comms: list[FakeComm]
    nodes: list[Node]  # where it sits on each rank's stream
    thread: str
    lock_held: bool
    extra: dict = field(default_factory=dict)


class FakeNccl:
    """torch.cuda.nccl's functions, with its argument conventions."""

    SUM = 0

    def __init__(self, fake: FakeCuda, version: tuple[int, ...]) -> None:
        self.fake = fake
        self._version = version
        self._ids = itertools.count()
        self._joining: dict[bytes, set[int]] = {}
        self._joined = threading.Condition()
        self.fail_next: dict[str, str] = {}  # function name -> message of the error its next call raises
        self.init_calls: list[FakeComm] = []

    def version(self) -> tuple[int, ...]:
        return self._version

    def unique_id(self) -> bytes:
        return f"uid-{next(self._ids)}".encode().ljust(128, b"\0")  # NCCL_UNIQUE_ID_BYTES

    def init_rank(self, num_ranks: int, uid: bytes, rank: int) -> FakeComm:
        with self._joined:
            joined = self._joining.setdefault(uid, set())
            joined.add(rank)
            self._joined.notify_all()
            if not self._joined.wait_for(lambda: len(joined) == num_ranks, INIT_TIMEOUT_S):
                raise RuntimeError(
                    f"NCCL Error 6: init of rank {rank}: ranks {sorted(joined)} of {num_ranks} joined"
                )
        comm = FakeComm(uid, rank, num_ranks, threading.current_thread().name)
        with self.fake.lock:
            self.init_calls.append(comm)
        return comm

    # collectives ------------------------------------------------------------------------------------------------
    def all_reduce(self, inputs, outputs=None, op=SUM, streams=None, comms=None) -> None:
        outputs = inputs if outputs is None else outputs
        self._check("all_reduce", inputs, outputs, streams, comms, reduces=True)
        result = self._reduce(inputs, op)
        for out in outputs:
            out.copy_(result)
        self._log("all_reduce", inputs, outputs, streams, comms, op=op)

    def reduce(self, inputs, output=None, root=0, op=SUM, streams=None, comms=None) -> None:
        output = inputs[root] if output is None else output
        self._check("reduce", inputs, None, streams, comms, reduces=True)
        assert output.numel() == inputs[0].numel() and output.is_contiguous(), "reduce: bad output"
        output.copy_(self._reduce(inputs, op))
        self._log("reduce", inputs, [output], streams, comms, op=op, root=root)

    def broadcast(self, inputs, root=0, streams=None, comms=None) -> None:
        self._check("broadcast", inputs, None, streams, comms)
        source = inputs[root].clone()
        for t in inputs:
            t.copy_(source)
        self._log("broadcast", inputs, inputs, streams, comms, root=root)

    def all_gather(self, inputs, outputs, streams=None, comms=None) -> None:
        self._check("all_gather", inputs, outputs, streams, comms, out_factor=len(inputs))
        gathered = torch.cat([t.view(-1) for t in inputs])
        for out in outputs:
            out.copy_(gathered)
        self._log("all_gather", inputs, outputs, streams, comms)

    def reduce_scatter(self, inputs, outputs, op=SUM, streams=None, comms=None) -> None:
        n = len(inputs)
        self._check("reduce_scatter", inputs, outputs, streams, comms, reduces=True, out_factor=1 / n)
        result = self._reduce(inputs, op)
        for i, out in enumerate(outputs):
            out.copy_(result.view(n, -1)[i])
        self._log("reduce_scatter", inputs, outputs, streams, comms, op=op)

    # what NCCL checks, and the arithmetic -----------------------------------------------------------------------
    def _check(self, name, inputs, outputs, streams, comms, *, reduces=False, out_factor=1.0) -> None:
        message = self.fail_next.pop(name, None)
        if message is not None:
            raise RuntimeError(f"NCCL Error 3: {message}")
        n = len(inputs)
        assert n > 0 and comms is not None and len(comms) == n, f"{name}: one communicator per input"
        assert all(isinstance(c, FakeComm) for c in comms), f"{name}: not communicators: {comms}"
        assert len({c.uid for c in comms}) == 1, f"{name}: communicators of different cliques"
        assert [c.rank for c in comms] == list(range(n)) and comms[0].size == n, f"{name}: not in rank order"
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
        assert all(t.numel() == inputs[0].numel() for t in inputs), f"{name}: inputs differ in size"
        if outputs is not None:
            assert len(outputs) == n, f"{name}: one output per input"
            assert all(o.numel() == inputs[0].numel() * out_factor for o in outputs), f"{name}: output size"

    def _reduce(self, inputs, op: int) -> torch.Tensor:
        result = inputs[0].clone()
        for t in inputs[1:]:
            if op in (0, 4):
                result.add_(t)
            elif op == 1:
                result.mul_(t)
            else:
                (torch.maximum if op == 2 else torch.minimum)(result, t, out=result)
        if op == 4:
            if not result.dtype.is_floating_point:
                return result.div_(len(inputs), rounding_mode="trunc")
            result.div_(len(inputs))
        return result

    def _log(self, name, inputs, outputs, streams, comms, **extra) -> None:
        nodes = [s._append("nccl", name) for s in streams]
        call = FakeCall(
            name, list(inputs), list(outputs), list(streams), list(comms), nodes,
            threading.current_thread().name, self.fake.launch_lock.held_by_me(), extra,
        )  # fmt: skip
        with self.fake.lock:
            self.fake.calls.append(call)


@dataclass
class FakeCopy:
    dst: torch.Tensor
    src: torch.Tensor
    src_stream: FakeStream
    dst_stream: FakeStream
    node: Node
    lock_held: bool


class FakeCuda:
    """Stands in for threadpar.comm.cuda_api.TorchCuda (pass it as World(cuda=...))."""

    def __init__(self, nccl_version: tuple[int, ...] = (2, 21, 5)) -> None:
        self.lock = threading.RLock()  # guards the fake's own records
        self.nccl = FakeNccl(self, nccl_version)
        self.launch_lock = OwnedLock()
        self.cliques = CliquePool()  # threadpar's own pool: plain Python, nothing to fake
        self.calls: list[FakeCall] = []
        self.copies: list[FakeCopy] = []
        self.comm_streams: list[FakeStream] = []
        self.recorded: list[tuple[torch.Tensor, FakeStream]] = []  # record_stream calls
        self.hung = False
        self.device_error: str | None = None  # raised by every event query (a sticky CUDA error)
        self.async_error_message: str | None = None  # what ncclCommGetAsyncError reports
        self._local = threading.local()
        self._ids = itertools.count()

    # the CudaApi ------------------------------------------------------------------------------------------------
    def nccl_available(self) -> bool:
        return True

    def comm_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(self, f"comm{next(self._ids)}", device, priority=-1)
        with self.lock:
            self.comm_streams.append(stream)
        return stream

    def _current(self) -> dict:
        if not hasattr(self._local, "current"):
            self._local.current = {}
        return self._local.current

    def current_stream(self, device: torch.device) -> FakeStream:
        current = self._current()
        if device not in current:
            name = f"default[{threading.current_thread().name}]"
            current[device] = FakeStream(self, name, device)
        return current[device]

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def on_streams(self, *streams: FakeStream):
        current = self._current()
        saved = dict(current)
        for stream in streams:
            current[stream.device] = stream
        try:
            yield
        finally:
            current.clear()
            current.update(saved)

    @contextlib.contextmanager
    def device_guard(self, device: torch.device):
        yield

    def copy_(
        self, dst: torch.Tensor, src: torch.Tensor, src_stream: FakeStream, dst_stream: FakeStream
    ) -> None:
        # As torch does across devices: on the source's stream, fenced both ways with the destination's.
        if src_stream is not dst_stream:
            before = FakeEvent(self)
            before.record(dst_stream)
            src_stream.wait_event(before)
        node = src_stream._append("copy")
        if src_stream is not dst_stream:
            after = FakeEvent(self)
            after.record(src_stream)
            dst_stream.wait_event(after)
        dst.copy_(src)
        with self.lock:
            self.copies.append(
                FakeCopy(dst, src, src_stream, dst_stream, node, self.launch_lock.held_by_me())
            )

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            self.recorded.append((tensor, stream))

    def synchronize(self, device: torch.device) -> None:
        pass  # results are computed when enqueued

    def async_error(self, comm: FakeComm) -> str | None:
        return self.async_error_message

    # for tests --------------------------------------------------------------------------------------------------
    def mark(self, stream: FakeStream, label: str) -> Node:
        """Enqueue a labelled no-op (stands for a kernel) and return where it sits."""
        return stream._append("mark", label)

    def ordered(self, a: Node, b: Node) -> bool:
        """Would CUDA finish a before starting b? (stream order, plus waits on recorded events)."""
        stack, seen = [b], set()
        while stack:
            stream, index = stack.pop()
            if stream is a.stream and index >= a.index:
                return True
            if (id(stream), index) in seen:
                continue
            seen.add((id(stream), index))
            if index > 0:
                stack.append(Node(stream, index - 1))
            op = stream.ops[index]
            if op[0] == "wait" and op[2] is not None:
                stack.append(op[2])
        return False

    def hang(self) -> None:
        self.hung = True

    def resume(self) -> None:
        self.hung = False

    def calls_named(self, name: str) -> list[FakeCall]:
        return [c for c in self.calls if c.name == name]


def run_fake_gpus(
    fn, world_size: int, fake: FakeCuda, *, backend: str = "nccl", timeout: float = 5.0, **layout
):
    """Run `fn` on `world_size` rank threads whose GPUs are `fake` (CPU tensors); re-raise a rank's own error."""
    world = World(
        layout=Layout.build(world_size, **layout),
        backend=backend,
        devices=(torch.device("cpu"),) * world_size,
        timeout=timeout,
        seed=0,
        intraop_threads=1,
        cuda=fake,
    )
    try:
        return _Launch(world, fn, (), {}).run()
    except RankFailedError as failed:
        failed.error.add_note(f"(raised on rank {failed.rank})")
        raise failed.error from None
