"""Test double for CUDA streams and events: `FakeCuda` stands in for threadpar's CudaApi and NcclRuntime (the
double of NCCL's C API, `FakeNccl`, is in fake_nccl.py; the device that runs both, in fake_device.py).

A small simulation rather than a mock:
- Streams keep what was enqueued on them; an event remembers where it was last recorded; a wait enqueues
  an edge to that point. `fake.ordered(a, b)` answers "would CUDA run a before b?" from stream order and
  event edges, so tests check ordering semantics rather than call sequences.
- NCCL kernels run on the streams only once every rank's matching part has reached its stream's head
  (fake_device.py): an event recorded after one stays incomplete until then, a synchronize waits, a host op
  on one of its buffers waits (ordered) or is a race (not ordered). `run_fake_gpus` runs every rank thread
  under `DeviceTouch` and ends with every stream run to its end, so a hang is reported, not missed.
- `FakeNccl` is NCCL's C API with NCCL's rules (fake_nccl.py); it logs every call here (`calls`: one per
  rank and call, with its thread).
- The device can hang (NCCL kernels never run until `resume()`), and every event query can raise a sticky
  CUDA error (`device_error`). NCCL's asynchronous error is `fake.nccl.async_error_code`.
- Several FakeCudas sharing one `FakeFabric` are the GPUs of several simulated processes
  (`run_fake_gpu_processes`): their NCCL cliques span them.
Devices are the double's GPUs, `simgpu:i` (sim_gpu.py: device tensors whose memory is host memory, which torch
keeps apart from host tensors), and every thread has its own default stream per device: the general case of
ranks that compute on their own streams (on a real GPU, threads share the device's default stream unless told
not to). A copy between host and device runs as CUDA runs it (`copy`: synchronous unless non_blocking with
pinned memory, then a kernel on the current stream). A rank's autograd device thread (`autograd_thread=True`)
uses its rank's streams, as the engine runs backward ops on their forward ops' streams. Each rank thread has a
GPU of its own, its current device (fake_device_index.py), which its streams carry: an event recorded on one
GPU's stream cannot be recorded on another's (FakeEvent.record), as in torch. Its logs (`calls`, `copies`,
`recorded`) hold tensors weakly (`TensorRecord`), so they never keep alive what threadpar let go of.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from threadpar.comm.nccl import bootstrap
from threadpar.comm.nccl.resources import CliquePool, CommStreams, DeviceLocks
from threadpar.comm.nccl.watchdog import Watchdog
from threadpar.errors import GraphCaptureError, RankFailedError
from threadpar.runtime.devices import Gpus, gpus_of
from threadpar.runtime.launch import _Launch, process_world
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv
from threadpar.runtime.world import World
from threadpar.testing import raise_root_cause
from threadpar.topology import Layout

from . import fake_device, fake_graph, sim_gpu
from .fake_autograd_thread import device_threads
from .fake_device import DeviceTouch, TensorRecord
from .fake_device_index import current_streams, fake_device_index
from .fake_graph import FakeGraph
from .fake_nccl import FakeComm, FakeFabric, FakeNccl

__all__ = [
    "FakeComm", "FakeCuda", "FakeFabric", "FakeNccl", "fake_gpu_processes", "launch_fake_gpu_processes",
    "run_fake_gpu_processes", "run_fake_gpus", "simulated_gpus",
]  # fmt: skip

# The mode of FakeCudas made without lazy=: [False] (an operation runs once its parts are all issued), or [True]
# while conftest's `fake_mode` fixture runs a test lazily (an operation runs only when something needs it).
LAZY_DEFAULT = [False]

STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp: kStreamsPerPool = 1 << kStreamsPerPoolBits (5)


class Node(NamedTuple):
    """A position in a stream: the op at `index`."""

    stream: FakeStream
    index: int


class FakeStream:
    def __init__(self, fake: FakeCuda, name: str, device: torch.device, priority: int = 0) -> None:
        self.fake, self.name, self.device, self.priority = fake, name, device, priority
        self.device_index = _gpu_of(device)  # the fake GPU it belongs to
        self.ops: list[tuple] = []  # what was enqueued, in order (the log `ordered` reads)
        self.done_upto = -1  # the device has run every op up to this one (fake_device.advance)
        self.kernels: dict[int, Any] = {}  # node index -> NCCL kernel not yet run there
        self.failed: list[tuple[int, str, type]] = []  # (node index, error, its kind) of kernels that failed
        self.capture: FakeGraph | None = None  # the graph capturing this stream's work (fake_graph.py)
        with fake.lock:
            fake.streams_made.append(self)

    def _append(self, *op: Any) -> Node:
        graph = self.capture
        if graph is not None:  # (captured: logged in the graph, never run by the device)
            return Node(self, -1 - graph.append(self, op[0]))
        with fake_device.RUN_LOCK:
            self.ops.append(op)
            return Node(self, len(self.ops) - 1)

    def wait_event(self, event: FakeEvent) -> None:
        # Waits for the event's most recent record only, as cudaStreamWaitEvent does (CUDA runtime API docs;
        # torch.cuda.Stream.wait_event -> c10/cuda/CUDAStream.h). Recorded later: not waited for. The stream
        # may be on another device than the event: c10/cuda/CUDAEvent.h, CUDAEvent::block, checks no device
        # (cudaStreamWaitEvent across devices is legal, CUDA programming guide, "Stream and Event Behavior").
        graph = event.captured
        if graph is not None:  # recorded in a capture: waiting joins this stream to it (fake_graph.py)
            if graph.state != "capturing" or self.capture not in (None, graph):
                raise fake_graph.cuda_error(
                    fake_graph.CAPTURED_EVENT,
                    "operation not permitted on an event last recorded in a capturing stream",
                    f"{self!r} waits on an event recorded in a graph capture",
                )
            self.capture = graph
            graph.append(self, "wait", event)
            graph.entries.append(fake_graph._Wait(self, event))
            return
        if self.capture is not None and event.node is not None:
            raise fake_graph.cuda_error(
                fake_graph.ISOLATION,
                "dependency created on uncaptured work in another stream",
                f"the capturing {self!r} waits on an event recorded outside the capture",
            )
        self._append("wait", event, event.node)

    def synchronize(self) -> None:
        """The host waits for everything enqueued so far (cudaStreamSynchronize)."""
        self.fake.refuse_during_capture(f"synchronize of {self!r}", self)
        node = self._append("host-sync")
        fake_device.demand(self, node.index, f"synchronize of {self!r}")
        with self.fake.lock:
            self.fake.host_syncs.append(node)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.node: Node | None = None  # where it was last recorded (None: never: waiting on it is a no-op)
        self.device_index: int | None = None  # the fake GPU of its first recording stream (None: not yet)
        self.captured: FakeGraph | None = None  # the graph it was last recorded in, if that was a capture
        self.captured_at: tuple[FakeStream, int] | None = None  # (stream, index in the capture's log)

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.fake.current_stream(sim_gpu.device(fake_device_index()))
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
        graph = stream.capture
        if graph is not None:
            self.captured, self.captured_at = graph, (stream, graph.append(stream, "record", self))
            graph.entries.append(fake_graph._Record(self, stream))
            return
        self.captured = self.captured_at = None
        self.node = stream._append("record", self)

    def _refuse_if_captured(self, what: str) -> None:
        if self.captured is not None:  # (CUDA keeps a captured record inside the graph: never queried again)
            raise fake_graph.cuda_error(
                fake_graph.CAPTURED_EVENT,
                "operation not permitted on an event last recorded in a capturing stream",
                f"{what} of an event recorded in a graph capture",
            )

    def query(self) -> bool:
        """cudaEventQuery: has the device run everything before the record? Never blocks."""
        self._refuse_if_captured("a query")
        if self.fake.device_error is not None:
            raise RuntimeError(f"CUDA error: {self.fake.device_error}")
        if self.node is None:
            return True
        return fake_device.query(self.node.stream, self.node.index)

    def synchronize(self) -> None:
        """cudaEventSynchronize: the host waits until the device has run everything before the record."""
        self._refuse_if_captured("a synchronize")
        self.fake.refuse_during_capture("an event synchronize", None)
        if self.node is not None:
            fake_device.demand(
                self.node.stream, self.node.index, f"synchronize of an event on {self.node.stream!r}"
            )


@dataclass
class FakeCall:
    """One rank's NCCL call, as the double's log keeps it."""

    name: str
    inputs: list[TensorRecord]  # weak: the log keeps no buffer alive
    outputs: list[TensorRecord]
    stream: FakeStream
    comm: FakeComm
    node: Node  # where it sits on its stream
    thread: str
    extra: dict = field(default_factory=dict)


@dataclass
class FakeCopy:
    dst: TensorRecord
    src: TensorRecord
    src_stream: FakeStream
    dst_stream: FakeStream
    node: Node


class FakeCuda:
    """Stands in for threadpar.comm.nccl.cuda_api.TorchCuda (the CudaApi) and LibraryNcclRuntime (the
    NcclRuntime) at once (pass it as World(cuda=...)): its fake NCCL enqueues on its fake streams, as the
    real library does on CUDA's, so one object models the GPUs and the library of one process. Each
    Protocol's members are in their own section below; `cuda` is the runtime's view of the primitives (itself)."""

    def __init__(
        self,
        nccl_version: tuple[int, ...] = (2, 27, 3),
        fabric: FakeFabric | None = None,
        *,
        lazy: bool | None = None,
        autograd_thread: bool = False,
        watchdog_interval: float = 0.02,
    ) -> None:
        """lazy: an NCCL operation runs only when something needs its result (fake_device.py), the latest
        schedule a GPU may pick, which reports a buffer touched out of order as a race even after every rank
        issued its part; else once every part is issued (None: the suite's mode, LAZY_DEFAULT, set by
        conftest's fixture). autograd_thread: run_fake_gpus runs every backward on a thread of its own per
        rank, without the rank's context, as CUDA's autograd engine does (fake_autograd_thread.py), in a
        launch with torch_distributed=False: with it on (the default), the rank's torch.distributed session
        turns autograd's multithreading off, and the engine runs backward on the rank thread, as the double
        then does (a thread that turns it off, e.g. graphed_step's capture, runs its backward itself too).
        watchdog_interval: the watchdog's period (tests look more often than torch's 100 ms)."""
        sim_gpu.install()  # (the double's GPUs are a device of torch's, registered on first use: once per process)
        self.lock = threading.RLock()  # guards the fake's own records
        self.lazy = LAZY_DEFAULT[0] if lazy is None else lazy
        self.autograd_thread = autograd_thread
        self.races: list[str] = []  # host ops that touched a pending NCCL operation's buffer unordered
        self.streams_made: list[FakeStream] = []
        self.nccl = FakeNccl(self, nccl_version, fabric)
        self.device_locks = DeviceLocks()  # threadpar's own process-wide bookkeeping: nothing to fake
        self.cliques = CliquePool()
        self.streams = CommStreams()
        self.watchdog = Watchdog(watchdog_interval)
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
        self.capturing: FakeGraph | None = None  # the process's capture underway (one at a time)
        self.allocator_stuck: str | None = None  # a failed capture left the allocator's capture underway

    # the CudaApi ------------------------------------------------------------------------------------------------
    def pool_stream(self, device: torch.device, priority: int) -> FakeStream:
        """torch.cuda.Stream(device, priority): c10/cuda/CUDAStream.cpp, getStreamFromPool, hands out one of
        kStreamsPerPool = 32 streams per device and priority level, round-robin (get_idx: counter++ % 32), made
        once per device and never destroyed: the 33rd request gets the 1st stream again. Priorities outside
        the device's range are clamped (torch.cuda.Stream's docs); the double's range is [-1, 0]. The device
        is the calling thread's fake GPU (fake_device_index.py): each GPU has pools of its own."""
        level, gpu = min(max(priority, -1), 0), _gpu_of(device)
        key = (device, gpu, level)
        with self.lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = [
                    FakeStream(self, f"pool{level}.{i}@gpu{gpu}", sim_gpu.device(gpu), level)
                    for i in range(STREAMS_PER_POOL)
                ]
                self._pools[key] = pool
            index = self._pool_counters.get(key, 0)
            self._pool_counters[key] = index + 1
            stream = pool[index % STREAMS_PER_POOL]
            self.comm_streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        """The calling thread's current stream on `device` (its own default stream until on_streams)."""
        device = sim_gpu.device(_gpu_of(device))
        current = current_streams(self)
        stream = current.get(device)
        if stream is None:
            name = f"default[{threading.current_thread().name}]@gpu{device.index}"
            stream = current[device] = FakeStream(self, name, device)
        return stream

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def on_streams(self, *streams: FakeStream):
        current = current_streams(self)
        saved = dict(current)
        for stream in streams:
            current[sim_gpu.device(stream.device_index)] = stream
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
        # As torch does across devices (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device): the copy
        # runs on the source device's current stream, which first waits for an event recorded on the
        # destination device's current stream; then the destination's stream waits for the copy. (The
        # double's devices are all one device: distinct streams stand for distinct devices here.)
        if src_stream is not dst_stream:
            before = FakeEvent(self)
            before.record(dst_stream)
            src_stream.wait_event(before)
        node = src_stream._append("copy")
        if src_stream is not dst_stream:
            after = FakeEvent(self)
            after.record(src_stream)
            dst_stream.wait_event(after)
        with self.on_streams(src_stream):
            dst.copy_(src)
        with self.lock:
            self.copies.append(FakeCopy(TensorRecord(dst), TensorRecord(src), src_stream, dst_stream, node))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str, sync: bool, index: int) -> None:
        """sim_gpu.CopyModel: a copy between host and GPU `index` (dst, src: host memory), as
        aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda, runs it on the current stream:
        - synchronous (`non_blocking=False`, or pageable host memory): at::cuda::memcpy_and_sync, the copy and a
          cudaStreamSynchronize, so the host waits for everything the stream holds; refused in a capture
          (cudaErrorStreamCaptureUnsupported, 900: CUDA's stream capture forbids a synchronization);
        - asynchronous (`non_blocking=True` with pinned host memory): cudaMemcpyAsync, a kernel on the stream
          that runs when the stream reaches it: the host touching either buffer before a synchronization
          that orders it is a race (fake_device.DeviceTouch reports it); in a capture, a node of the graph
          (the capture's recorder replays the copy, reading the host memory anew at each replay)."""
        stream = self.current_stream(sim_gpu.device(index))
        graph = self.capturing
        if sync:
            if graph is not None and (graph.thread == threading.get_ident() or stream.capture is not None):
                raise GraphCaptureError(
                    f"{what} in a step being captured as a CUDA graph: a copy between host and device without "
                    "non_blocking=True and pinned host memory synchronizes the stream (Copy.cu: memcpy_and_sync; "
                    f"CUDA: cudaErrorStreamCaptureUnsupported, error 900), at\n  {fake_graph.user_line()}\n"
                    "Keep the value on the device (make tensors with device=..., move data before the step), or "
                    "copy with non_blocking=True from or to pinned memory."
                )
            stream.synchronize()
            with fake_device.inside_double(), torch.no_grad():
                dst.copy_(src)
            return
        if stream.capture is not None:
            with fake_device.inside_double(), torch.no_grad():
                dst.copy_(src)
            return
        op = fake_device.DeviceOp(f"{what} (non_blocking)", 1, _run_copy)
        part = fake_device.Part(op, 0, self, src, dst)
        op.parts[0] = part
        node = stream._append("copy", what)
        with self.lock:
            self.copies.append(FakeCopy(TensorRecord(dst), TensorRecord(src), stream, stream, node))
        fake_device.enqueue([fake_device.Kernel(stream, node.index, [part])], self.lazy)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            self.recorded.append((TensorRecord(tensor), stream))

    def synchronize(self, device: torch.device) -> None:
        """torch.cuda.synchronize(device): cudaDeviceSynchronize on that device, so the host waits until every
        stream of that GPU (in this process) has run what it holds; other GPUs' streams run on (CUDA runtime
        API docs: it blocks "until the device has completed all preceding requested tasks"). A device that is
        not one of the double's GPUs (the host: run_everything, tests) stands for all of them."""
        self.refuse_during_capture("a device synchronize", None)
        gpu = _gpu_of(device) if device.type == sim_gpu.DEVICE_TYPE else None  # (no index: the current GPU)
        with self.lock:
            streams = [s for s in self.streams_made if gpu is None or s.device_index == gpu]
        for stream in streams:
            fake_device.demand(stream, len(stream.ops) - 1, f"device synchronize ({stream!r})")

    def graph(self) -> FakeGraph:
        return FakeGraph(self)

    def capture(self, graph: FakeGraph, stream: FakeStream, generators: Any):
        return fake_graph.capture(self, graph, stream, generators)

    def refuse_during_capture(self, what: str, stream: FakeStream | None) -> None:
        """A host synchronization on the capturing thread, or of a capturing stream, breaks the capture
        (cudaErrorStreamCaptureUnsupported); threadpar captures thread-locally, so other threads may."""
        graph = self.capturing
        if graph is not None and (
            graph.thread == threading.get_ident() or (stream is not None and stream.capture)
        ):
            raise fake_graph.cuda_error(
                fake_graph.UNSUPPORTED, "operation not permitted when stream is capturing", what
            )

    def report_race(self, message: str) -> None:
        with self.lock:
            self.races.append(message)

    # the NcclRuntime (nccl, device_locks, cliques, streams, watchdog are set in __init__) -----------------------
    @property
    def cuda(self) -> FakeCuda:
        return self

    def nccl_available(self) -> bool:
        return True

    def prepare_environment(self) -> None:
        bootstrap.prepare_environment()  # threadpar's own code: it sets what the double's NCCL reads

    # for FakeNccl -----------------------------------------------------------------------------------------------
    def log_nccl(self, name, inputs, outputs, stream, comm, extra) -> Node:
        node = stream._append("nccl", name)
        call = FakeCall(
            name, [TensorRecord(t) for t in inputs], [TensorRecord(o) for o in outputs if o is not None],
            stream, comm, node, threading.current_thread().name, extra,
        )  # fmt: skip
        with self.lock:
            self.calls.append(call)
        return node

    # for tests --------------------------------------------------------------------------------------------------
    def mark(self, stream: FakeStream, label: str) -> Node:
        """Enqueue a labelled no-op (stands for a kernel) and return where it sits."""
        return stream._append("mark", label)

    def ordered(self, a: Node, b: Node) -> bool:
        """Would CUDA finish a before starting b? (stream order, plus waits on recorded events)."""
        with fake_device.RUN_LOCK:
            return fake_device.ordered(a, b)

    def hang(self) -> None:
        """From now on, no NCCL kernel of this process runs (until resume)."""
        self.hung = True

    def resume(self) -> None:
        with fake_device.RUN_LOCK:
            self.hung = False
            fake_device.CHANGED.notify_all()

    def calls_named(self, name: str) -> list[FakeCall]:
        return [c for c in self.calls if c.name == name]

    def calls_of(self, name: str, rank: int) -> list[FakeCall]:
        """The calls named `name` by NCCL rank `rank` of their communicators, in order."""
        return [c for c in self.calls if c.name == name and c.comm.rank == rank]

    def touch_mode(self) -> DeviceTouch:
        """The DeviceTouch of a rank thread of this process (its current streams, its races)."""
        return DeviceTouch(self, self.current_stream)

    def run_everything(self) -> None:
        """The end of a launch: every stream runs to its end (a hang there is reported)."""
        self.synchronize(torch.device("cpu"))


def _gpu_of(device: torch.device) -> int:
    """The fake GPU a device names: simgpu:i is GPU i; a device without an index, the thread's current one."""
    if device.type == sim_gpu.DEVICE_TYPE and device.index is not None:
        return device.index
    return fake_device_index()


def _run_copy(op: fake_device.DeviceOp) -> str | None:
    part = op.parts[0]
    assert part.input is not None and part.output is not None
    part.output.copy_(part.input)
    return None


def on_device(fake: FakeCuda, fn, touch: bool = True):
    """`fn` on a rank thread of a double's launch: its copies on the fake's streams (sim_gpu.bind) and, with
    `touch`, under DeviceTouch (fake_device.py)."""

    def body() -> Any:
        previous = sim_gpu.bind(fake)
        try:
            with fake.touch_mode() if touch else contextlib.nullcontext():
                return fn()
        finally:
            sim_gpu.bind(previous)

    return body


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
    `rank_cpus`: the cores the rank threads run on (World.rank_cpus; None: unpinned, as GPU ranks are).
    After the launch every stream runs to its end: an NCCL operation a rank issued that can never run fails
    the run, as it would hang a GPU."""
    world = World(
        layout=Layout.build(world_size, **layout),
        backend=backend,
        devices=tuple(sim_gpu.device(r) for r in range(world_size)),
        timeout=timeout,
        seed=0,
        intraop_threads=1,
        cuda=fake,
        rank_cpus=rank_cpus,
        torch_distributed=not fake.autograd_thread,  # (see FakeCuda's autograd_thread)
    )
    nccl = backend == "nccl"  # (the threads backend on the double's streams issues no NCCL operation)
    try:
        with (
            device_threads() if fake.autograd_thread else contextlib.nullcontext(),
            fake_device.watch_host_reads(),
        ):
            results = _Launch(world, on_device(fake, fn, touch=nccl), (), {}).run()
    except RankFailedError as failed:
        failed.error.add_note(f"(raised on rank {failed.rank})")
        raise failed.error from None
    if nccl:
        fake.run_everything()
    return results


@contextlib.contextmanager
def simulated_gpus(fake: FakeCuda, count: int = sim_gpu.DEVICE_COUNT):
    """While open, threadpar.launch (and the demo) in this process place GPU ranks on `count` of the double's
    GPUs (simgpu:i, `fake` their CUDA and NCCL), as they would on CUDA's: the code a GPU runs, launched the way
    a user launches it (runtime/devices.gpus_of). Rank threads copy through `fake` (sim_gpu.process_model);
    they run without DeviceTouch (run_fake_gpus adds it)."""
    if not 1 <= count <= sim_gpu.DEVICE_COUNT:
        raise ValueError(f"count={count}: the double has 1 to {sim_gpu.DEVICE_COUNT} GPUs per process")
    with (
        gpus_of(Gpus(sim_gpu.DEVICE_TYPE, lambda: count, fake)),
        sim_gpu.process_model(fake),
        device_threads() if fake.autograd_thread else contextlib.nullcontext(),
    ):
        yield


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
                    torch_distributed=not fakes[p].autograd_thread,  # (see FakeCuda's autograd_thread)
                ),
                Layout.build(processes * threads, **layout),
                backend,
                tuple(sim_gpu.device(r) for r in range(threads)),
                1,
                cuda=fakes[p],
            )
            with (
                device_threads() if fakes[p].autograd_thread else contextlib.nullcontext(),
                fake_device.watch_host_reads(),
            ):
                outcomes[p] = _Launch(world, on_device(fakes[p], fn, touch=backend == "nccl"), (), {}).run()
            fakes[p].run_everything()
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
