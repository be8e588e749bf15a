"""Test double for CUDA streams and events: `FakeCuda` stands in for threadpar's CudaApi (the double of NCCL's
C API, `FakeNccl`, is in fake_nccl.py).

A small simulation rather than a mock:
- Streams keep what was enqueued on them; an event remembers where it was last recorded; a wait enqueues
  an edge to that point. `fake.ordered(a, b)` answers "would CUDA run a before b?" from stream order and
  event edges, so tests check ordering semantics rather than call sequences.
- `FakeNccl` is NCCL's C API with NCCL's rules (fake_nccl.py); it computes the results on the CPU tensors
  and logs every launched operation here (`calls`, one per clique and collective, with the thread and
  whether it held the launch lock).
- The device can hang (events recorded while hung stay incomplete until `resume()`), the next call of an
  NCCL function can fail, and an asynchronous NCCL error can be set.
- Several FakeCudas sharing one `FakeFabric` are the GPUs of several simulated processes
  (`run_fake_gpu_processes`): their NCCL cliques span them.
Devices are CPU devices, and every thread has its own default stream: the general case of ranks that
compute on their own streams (on a real GPU, threads share the device's default stream unless told not to).
Each rank thread still has a GPU of its own, a fake index (fake_device_index.py) its streams carry: an event
recorded on one GPU's stream cannot be recorded on another's (FakeEvent.record), as in torch.

Stricter modes (issue 22): `FakeCuda(lazy=True)` runs a collective only when something waits on it and reports
a buffer changed in between as a race (fake_device_queue.py; conftest's `fake_mode` fixture runs nccl-path
modules in both modes); `FakeCuda(autograd_thread=True)` runs every backward on a device thread of its own
without the rank's context (fake_autograd_thread.py). Its logs (`calls`, `copies`, `recorded`) hold tensors
weakly (`TensorRecord`), so they never keep alive what threadpar let go of.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from threadpar.comm.nccl.library import async_error_text
from threadpar.comm.nccl.resources import CliquePool, CommStreams, DeviceInits
from threadpar.errors import RankFailedError
from threadpar.runtime.launch import _Launch, process_world
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv
from threadpar.runtime.world import World
from threadpar.testing import raise_root_cause
from threadpar.topology import Layout

from .fake_autograd_thread import device_threads
from .fake_device_index import fake_device_index
from .fake_device_queue import TensorRecord, flush
from .fake_nccl import FakeComm, FakeFabric, FakeNccl

__all__ = [
    "FakeComm", "FakeCuda", "FakeFabric", "FakeNccl", "fake_gpu_processes", "launch_fake_gpu_processes",
    "run_fake_gpu_processes", "run_fake_gpus",
]  # fmt: skip


# The mode of FakeCudas made without lazy=: [False] (eager), or [True] while conftest's fixture runs a test lazily.
LAZY_DEFAULT = [False]

STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp: kStreamsPerPool = 1 << kStreamsPerPoolBits (5)


class Node(NamedTuple):
    """A position in a stream: the op at `index`."""

    stream: FakeStream
    index: int


class FakeStream:
    def __init__(
        self, fake: FakeCuda, name: str, device: torch.device, priority: int = 0, device_index: int = 0
    ) -> None:
        self.fake, self.name, self.device, self.priority = fake, name, device, priority
        self.device_index = device_index  # the fake GPU it belongs to (fake_device_index.py)
        self.ops: list[tuple] = []
        self.pending: dict[int, Any] = {}  # lazy mode: node index -> the collective waiting there to run
        self.flushed = -1  # lazy mode: every node up to this one has run
        fake.streams_made.append(self)

    def _append(self, *op: Any) -> Node:
        with self.fake.lock:
            self.ops.append(op)
            return Node(self, len(self.ops) - 1)

    def wait_event(self, event: FakeEvent) -> None:
        # Waits for the event's most recent record only, as cudaStreamWaitEvent does (CUDA runtime API docs;
        # torch.cuda.Stream.wait_event -> c10/cuda/CUDAStream.h). Recorded later: not waited for. The stream
        # may be on another device than the event: c10/cuda/CUDAEvent.h, CUDAEvent::block, checks no device
        # (cudaStreamWaitEvent across devices is legal, CUDA programming guide, "Stream and Event Behavior").
        self._append("wait", event, event.node)
        if self.fake.lazy and event.node is not None and not self.pending:
            # A stream whose work the double runs at once (a compute stream) must find the awaited work done;
            # a comm stream with collectives still pending just records the edge (fake_device_queue.flush).
            flush(event.node.stream, event.node.index)

    def synchronize(self) -> None:
        """The host waits for everything enqueued so far (cudaStreamSynchronize)."""
        if self.fake.lazy:
            flush(self)
        node = self._append("host-sync")
        with self.fake.lock:
            self.fake.host_syncs.append(node)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.node: Node | None = None  # where it was last recorded (None: never: waiting on it is a no-op)
        self.device_index: int | None = None  # the fake GPU of its first recording stream (None: not yet)
        self.complete = True

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current_stream(torch.device("cpu"))
        with self.fake.lock:
            # An event belongs to one device: c10/cuda/CUDAEvent.h, CUDAEvent::record, creates the CUDA event
            # lazily on the first recording stream's device and then TORCH_CHECKs that every later recording
            # stream is on that device (cudaEventRecord fails across devices, CUDA programming guide,
            # "Stream and Event Behavior"); torch.cuda.Event.record reaches it (torch/cuda/streams.py).
            if self.device_index is None:
                self.device_index = stream.device_index
            elif self.device_index != stream.device_index:
                raise RuntimeError(
                    f"Event device {self.device_index} does not match recording stream's device "
                    f"{stream.device_index} ({stream!r}): an event belongs to the device it was first "
                    "recorded on (c10/cuda/CUDAEvent.h, CUDAEvent::record); record a new event per device"
                )
        self.node = stream._append("record", self)
        self.complete = not self.fake.hung

    def query(self) -> bool:
        if self.fake.device_error is not None:
            raise RuntimeError(f"CUDA error: {self.fake.device_error}")
        if self.fake.hung and not self.complete:
            return False
        if self.fake.lazy and self.node is not None:  # the host asking makes a lazy stream progress
            flush(self.node.stream, self.node.index)
        return True


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
    inputs: list[TensorRecord]  # weak: the log keeps no buffer alive
    outputs: list[TensorRecord]
    streams: list[FakeStream]
    comms: list[FakeComm]
    nodes: list[Node]  # where it sits on each rank's stream
    thread: str
    lock_held: bool
    extra: dict = field(default_factory=dict)


@dataclass
class FakeCopy:
    dst: TensorRecord
    src: TensorRecord
    src_stream: FakeStream
    dst_stream: FakeStream
    node: Node
    lock_held: bool


class FakeCuda:
    """Stands in for threadpar.comm.nccl.cuda_api.TorchCuda (the CudaApi) and TorchNcclRuntime (the NcclRuntime)
    at once (pass it as World(cuda=...)): its fake NCCL enqueues on its fake streams, as the real library
    does on CUDA's, so one object models the GPUs and the library of one process. Each Protocol's members
    are in their own section below; `cuda` is the runtime's view of the primitives (itself)."""

    def __init__(
        self,
        nccl_version: tuple[int, ...] = (2, 27, 3),
        fabric: FakeFabric | None = None,
        *,
        lazy: bool | None = None,
        autograd_thread: bool = False,
    ) -> None:
        """lazy: collectives run only when something waits on them, and a buffer changed between launch and
        run is a race (fake_device_queue.py); None: the suite's mode (LAZY_DEFAULT, set by conftest's
        fixture). autograd_thread: run_fake_gpus runs every backward on a thread of its own per rank, without
        the rank's context, as CUDA's autograd engine does (fake_autograd_thread.py)."""
        self.lock = threading.RLock()  # guards the fake's own records
        self.lazy = LAZY_DEFAULT[0] if lazy is None else lazy
        self.autograd_thread = autograd_thread
        self.races: list[str] = []  # lazy mode: buffers changed between a collective's launch and its run
        self.streams_made: list[FakeStream] = []
        self.nccl = FakeNccl(self, nccl_version, fabric)
        self.launch_lock = OwnedLock()
        self.cliques = CliquePool()  # threadpar's own pool: plain Python, nothing to fake
        self.inits = DeviceInits()  # threadpar's own bookkeeping, likewise
        self.streams = CommStreams()  # likewise
        # (device, fake GPU index, priority level) -> that pool (fake_device_index.py)
        self._pools: dict[tuple[torch.device, int, int], list[FakeStream]] = {}
        self._pool_counters: dict[tuple[torch.device, int, int], int] = {}
        self.calls: list[FakeCall] = []
        self.copies: list[FakeCopy] = []
        self.comm_streams: list[FakeStream] = []
        self.recorded: list[tuple[TensorRecord, FakeStream]] = []  # record_stream calls (weak)
        self.host_syncs: list[Node] = []  # where the host waited for a stream (FakeStream.synchronize)
        self.hung = False
        self.device_error: str | None = None  # raised by every event query (a sticky CUDA error)
        self.async_error_message: str | None = None  # what ncclCommGetAsyncError reports
        self._local = threading.local()
        self._ids = itertools.count()

    # the CudaApi ------------------------------------------------------------------------------------------------
    def pool_stream(self, device: torch.device, priority: int) -> FakeStream:
        """torch.cuda.Stream(device, priority): c10/cuda/CUDAStream.cpp, getStreamFromPool, hands out one of
        kStreamsPerPool = 32 streams per device and priority level, round-robin (get_idx: counter++ % 32), made
        once per device and never destroyed: the 33rd request gets the 1st stream again. Priorities outside
        the device's range are clamped (torch.cuda.Stream's docs); the double's range is [-1, 0]. The device
        is the calling thread's fake GPU (fake_device_index.py): each GPU has pools of its own."""
        level, gpu = min(max(priority, -1), 0), fake_device_index()
        key = (device, gpu, level)
        with self.lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = [
                    FakeStream(self, f"pool{level}.{i}@gpu{gpu}", device, level, gpu)
                    for i in range(STREAMS_PER_POOL)
                ]
                self._pools[key] = pool
            index = self._pool_counters.get(key, 0)
            self._pool_counters[key] = index + 1
            stream = pool[index % STREAMS_PER_POOL]
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
            current[device] = FakeStream(self, name, device, device_index=fake_device_index())
        return current[device]

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def on_streams(self, *streams: FakeStream):
        current = self._current()
        saved = dict(current)
        for stream in streams:
            if self.lazy:  # host-issued work on a stream follows what waits there: that must run first
                flush(stream)
            current[stream.device] = stream
        try:
            yield
        finally:
            current.clear()
            current.update(saved)

    @contextlib.contextmanager
    def device_guard(self, device: torch.device):
        saved = getattr(self._local, "device", None)
        self._local.device = device
        try:
            yield
        finally:
            self._local.device = saved

    def guarded_device(self) -> torch.device | None:
        """The device a device_guard made current in this thread (None: none; CUDA's would be device 0)."""
        return getattr(self._local, "device", None)

    def copy_(
        self, dst: torch.Tensor, src: torch.Tensor, src_stream: FakeStream, dst_stream: FakeStream
    ) -> None:
        # As torch does across devices (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device): the copy
        # runs on the source device's current stream, which first waits for an event recorded on the
        # destination device's current stream; then the destination's stream waits for the copy. (The
        # double's devices are all one device: distinct streams stand for distinct devices here.)
        if self.lazy:  # the double copies at once: what the copy follows on either stream runs first
            flush(src_stream)
            flush(dst_stream)
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
                FakeCopy(
                    TensorRecord(dst),
                    TensorRecord(src),
                    src_stream,
                    dst_stream,
                    node,
                    self.launch_lock.held_by_me(),
                )
            )

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            self.recorded.append((TensorRecord(tensor), stream))

    def synchronize(self, device: torch.device) -> None:
        """cudaDeviceSynchronize: every stream runs what it holds."""
        if self.lazy:
            for stream in list(self.streams_made):
                flush(stream)

    def report_race(self, message: str) -> None:
        with self.lock:
            self.races.append(message)

    # the NcclRuntime (nccl, launch_lock, cliques, inits, streams are set in __init__) ---------------------------
    @property
    def cuda(self) -> FakeCuda:
        return self

    def nccl_available(self) -> bool:
        return True

    def async_error(self, comm: FakeComm) -> str | None:
        """As LibraryNcclRuntime.async_error, through the double's ncclCommGetAsyncError; a test may also
        set `async_error_message` (what that query's error string would say)."""
        return async_error_text(self.nccl, comm) or self.async_error_message

    # for FakeNccl -----------------------------------------------------------------------------------------------
    def log_nccl(self, name, inputs, outputs, streams, comms, extra) -> list[Node]:
        nodes = [s._append("nccl", name) for s in streams]
        call = FakeCall(
            name, [TensorRecord(t) for t in inputs], [TensorRecord(o) for o in outputs if o is not None],
            list(streams), list(comms), nodes, threading.current_thread().name, self.launch_lock.held_by_me(),
            extra,
        )  # fmt: skip
        with self.lock:
            self.calls.append(call)
        return nodes

    @contextlib.contextmanager
    def released_launch_lock(self):
        """While an NCCL part waits for the other processes' parts: let other launches in this process go on."""
        held = self.launch_lock.held_by_me()
        if held:
            self.launch_lock.__exit__()
        try:
            yield
        finally:
            if held:
                self.launch_lock.__enter__()

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
    fn,
    world_size: int,
    fake: FakeCuda,
    *,
    backend: str = "nccl",
    timeout: float = 5.0,
    rank_cpus: frozenset[int] | None = None,
    **layout,
):
    """Run `fn` on `world_size` rank threads whose GPUs are `fake` (CPU tensors); re-raise a rank's own error.
    `rank_cpus`: the cores the rank threads run on (World.rank_cpus; None: unpinned, as GPU ranks are)."""
    world = World(
        layout=Layout.build(world_size, **layout),
        backend=backend,
        devices=(torch.device("cpu"),) * world_size,
        timeout=timeout,
        seed=0,
        intraop_threads=1,
        cuda=fake,
        rank_cpus=rank_cpus,
    )
    try:
        with device_threads() if fake.autograd_thread else contextlib.nullcontext():
            return _Launch(world, fn, (), {}).run()
    except RankFailedError as failed:
        failed.error.add_note(f"(raised on rank {failed.rank})")
        raise failed.error from None


def fake_gpu_processes(processes: int, fabric: FakeFabric | None = None, **options: Any) -> list[FakeCuda]:
    """The GPUs of `processes` simulated processes: one FakeCuda each, their NCCLs on one fabric."""
    fabric = FakeFabric() if fabric is None else fabric
    return [FakeCuda(fabric=fabric, **options) for _ in range(processes)]


def launch_fake_gpu_processes(
    fn,
    fakes: list[FakeCuda],
    threads: int,
    *,
    backend: str = "nccl",
    timeout: float = 5.0,
    check_collectives: bool = False,
    **layout,
) -> list[Any]:
    """Run `fn` as len(fakes) simulated processes (threads of this interpreter sharing a HashStore, as
    threadpar.testing.launch_processes) x `threads` rank threads, process p's GPUs being fakes[p].
    Returns, per process, its per-thread results or the exception its launch raised."""
    import torch.distributed as dist

    processes, store = len(fakes), dist.HashStore()
    outcomes: list[Any] = [None] * processes

    def process_main(p: int) -> None:
        try:
            world = process_world(
                ProcessEnv(p, processes, store=store),
                LaunchConfig(
                    backend=backend,
                    timeout=timeout,
                    threads_per_process=threads,
                    check_collectives=check_collectives,
                ),
                Layout.build(processes * threads, **layout),
                backend,
                (torch.device("cpu"),) * threads,
                1,
                cuda=fakes[p],
            )
            with device_threads() if fakes[p].autograd_thread else contextlib.nullcontext():
                outcomes[p] = _Launch(world, fn, (), {}).run()
        except BaseException as error:
            outcomes[p] = error

    runners = [threading.Thread(target=process_main, args=(p,), daemon=True) for p in range(processes)]
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    return outcomes


def run_fake_gpu_processes(fn, fakes: list[FakeCuda], threads: int, **options) -> list[list[Any]]:
    """`launch_fake_gpu_processes`, re-raising the root-cause rank's own exception; returns each process's
    per-thread results."""
    outcomes = launch_fake_gpu_processes(fn, fakes, threads, **options)
    raise_root_cause(outcomes)
    return outcomes
