"""CUDA graph capture and replay on the double (`FakeCuda.graph()`, `FakeCuda.capture(...)`).

What a GPU does, and so what the double does:
- Capture records work, it does not run it (CUDA programming guide, "CUDA Graphs", stream capture): after
  the capture the tensors it wrote hold what they held before, tensors it allocated hold garbage, and NCCL
  calls issued into it were not sent. The double runs the captured aten ops on the host (Python after them
  needs their shapes) under a recorder (a TorchDispatchMode, below autograd, so backward's kernels come
  through it too), then at the capture's end restores every storage the capture wrote that existed
  before it, fills what it allocated with NaN (or an integer sentinel), and restores the generators it drew
  from (torch's graph-safe generators: capture records the offsets, each replay advances them,
  aten/src/ATen/cuda/CUDAGeneratorImpl.cpp). NCCL calls on a capturing stream are recorded (fake_nccl.py).
- Replay re-runs the record: the aten ops on the same tensors (their results copied into the captured
  outputs, the graph's static memory), the NCCL calls as new operations (the device waits for the peers'
  replays), the captured event records and waits as dependencies inside the replay. None of the step's
  Python runs: a branch taken at capture is taken at every replay.

CUDA's capture rules the double enforces (each raises what CUDA or torch would, named):
- capture on a non-default stream (aten/src/ATen/cuda/CUDAGraph.cpp, capture_begin: "CUDA graphs must be
  captured on a non-default stream");
- one capture underway per process (torch docs, notes/cuda.rst "Constraints": "Within a process, only one
  capture may be underway at a time"; c10/cuda/CUDACachingAllocator.cpp asserts `captures_underway.empty()`);
- no host synchronization on the capturing thread: `.item()` of a device tensor, `nonzero`, data-dependent
  branches, a copy between host and device that is not asynchronous (sim_gpu.py, fake_cuda_nccl's `copy`),
  synchronize of a stream, an event or the device (cudaErrorStreamCaptureUnsupported, 900); threadpar
  captures with capture_error_mode="thread_local", so other threads' calls are theirs;
- only work on a capturing stream is captured (CUDA programming guide, "Stream Capture": capture records the
  work launched into the capturing streams): host ops (on host tensors) and device ops on a stream that never
  joined the capture run once, at capture time, and are not replayed; a device op's host tensor argument (a
  0-dim scalar, read at launch: a kernel argument) is read once, at capture, and frozen into the graph, which
  the double refuses, naming the fix (make it a device tensor): the fused optimizers read a host lr so
  (aten/src/ATen/native/cuda/FusedAdamWKernel.cu takes `lr.item()` of a host lr tensor);
- an event last recorded in a capture cannot be queried, synchronized or waited on from outside it
  (cudaErrorCapturedEvent, 907); a capturing stream cannot wait on an event recorded outside the capture
  (cudaErrorStreamCaptureIsolation, 905);
- a stream that joined the capture (waited on a captured event) must be joined back into the origin stream
  before the capture ends (cudaErrorStreamCaptureUnjoined, 904), also when the step raised inside the capture:
  torch.cuda.graph's __exit__ ends the capture either way, its 904 replaces the step's error, and
  CUDAGraph::capture_end (aten/src/ATen/cuda/CUDAGraph.cpp) throws before its pool's endAllocateToPool, so the
  caching allocator keeps a capture underway and the process's next capture fails (`allocator_stuck`; the
  real CudaApi ends the pool itself: comm/nccl/cuda_api.py);
- torch's optimizers refuse a step in a capture unless capturable (torch/optim/optimizer.py,
  `_accelerator_graph_capture_health_check`: "Attempting CUDA graph capture of step() ... but param_groups'
  capturable is False"), a check torch makes for CUDA and XPU only, so the double makes it for its device
  (`_optimizer_health_check`, a global step pre-hook);
- NCCL: the communicators of one group call all captured by one graph or none (src/group.cc, "Either none or
  all communicators in a ncclGroup() can be CUDA graph captured"; src/enqueue.cc,
  ncclPlannerSetCapturingGraph), in fake_nccl.py.
(The CUDA error codes: driver_types.h, cudaError.)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from threadpar.errors import GraphCaptureError

from . import fake_device, sim_gpu, sim_gpu_engine

# aten ops that make the host wait for the device (the host reads a value, or an output's shape depends on
# the data): CUDA refuses the copy to the host during capture (cudaErrorStreamCaptureUnsupported).
_HOST_SYNCS = {
    "aten::_local_scalar_dense": "a host read of a tensor's value (.item(), float(t), bool(t), print(t))",
    "aten::is_nonzero": "a Python branch on a tensor's value (if t: / bool(t))",
    "aten::nonzero": "torch.nonzero (its output's size depends on the data)",
    "aten::nonzero_static": None,  # (static size: fine)
    "aten::masked_select": "masked_select (its output's size depends on the data)",
    "aten::unique_dim": "unique (its output's size depends on the data)",
    "aten::_unique2": "unique (its output's size depends on the data)",
    "aten::equal": "torch.equal (returns a Python bool)",
    "aten::item": "a host read of a tensor's value (.item())",
}

UNSUPPORTED = 900  # cudaErrorStreamCaptureUnsupported
ISOLATION = 905  # cudaErrorStreamCaptureIsolation
UNJOINED = 904  # cudaErrorStreamCaptureUnjoined
CAPTURED_EVENT = 907  # cudaErrorCapturedEvent


def cuda_error(code: int, text: str, what: str) -> RuntimeError:
    return RuntimeError(f"CUDA error: {text} (error {code}): {what}")


def user_line() -> str:
    """The innermost frame of the running step outside torch, threadpar's internals and this double."""
    for frame in reversed(traceback.extract_stack(sys._getframe(1))):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/tests/fakes/" in path or "/threadpar/" in path or "/contextlib" in path:
            continue
        return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'
    return "(no frame outside torch and threadpar)"


@dataclass
class _Aten:
    func: Any
    args: tuple
    kwargs: dict
    outs: list  # the captured outputs (flattened): the graph's static memory
    stream: Any  # the capturing thread's current stream when it ran


@dataclass
class _Nccl:
    nccl: Any  # the FakeNccl that recorded it
    queued: list  # its group's operations (fake_nccl._Queued)


@dataclass
class _Record:
    event: Any
    stream: Any


@dataclass
class _Wait:
    stream: Any
    event: Any


@dataclass
class FakeGraph:
    """torch.cuda.CUDAGraph on the double."""

    fake: Any
    entries: list = field(default_factory=list)
    origin: Any = None  # the capture's stream
    thread: int | None = None  # the capturing thread
    state: str = "new"  # new -> capturing -> captured
    joined: dict = field(default_factory=dict)  # stream -> its captured log: [(kind, event-or-None)]
    replays: int = 0
    _snapshots: dict = field(default_factory=dict)  # storage address -> (storage, its bytes before)
    _allocated: dict = field(default_factory=dict)  # storage address -> a tensor made during the capture
    _generators: dict = field(default_factory=dict)  # id -> (generator, its state before)

    # capture ----------------------------------------------------------------------------------------------------
    def append(self, stream: Any, kind: str, event: Any = None) -> int:
        """A stream's op during capture: logged in the capture (the device never sees it)."""
        log = self.joined.setdefault(stream, [])
        log.append((kind, event))
        return len(log) - 1

    def remember_generator(self, generator: torch.Generator | None) -> None:
        generator = torch.default_generator if generator is None else generator
        if id(generator) not in self._generators:
            self._generators[id(generator)] = (generator, generator.get_state())

    def before_write(self, t: torch.Tensor) -> None:
        """Keep what a tensor that existed before the capture held, the first time the capture writes it."""
        try:
            storage = sim_gpu.host(t).untyped_storage()
        except RuntimeError:
            return
        address = storage.data_ptr()
        if storage.nbytes() == 0 or address in self._allocated or address in self._snapshots:
            return
        self._snapshots[address] = (storage, storage.clone())

    def allocated(self, t: torch.Tensor) -> None:
        t = sim_gpu.host(t)
        try:
            address = t.untyped_storage().data_ptr()
        except RuntimeError:
            return
        if address not in self._snapshots:
            self._allocated.setdefault(address, t)

    def end(self) -> None:
        """The capture's end: check the joins, and leave memory and generators as a GPU's capture does."""
        unjoined = self.unjoined()
        if unjoined is not None:
            raise unjoined
        self.restore(poison=True)

    def unjoined(self) -> RuntimeError | None:
        """cudaStreamEndCapture's error if a stream that joined the capture was not joined back, else None."""
        origin = self.joined.get(self.origin, [])
        for stream, log in self.joined.items():
            if stream is self.origin or not log:
                continue
            if not _joined_back(self, stream, len(log) - 1, self.origin, len(origin) - 1):
                return cuda_error(
                    UNJOINED,
                    "the capture sequence contains a fork that was not joined to the primary stream",
                    f"{stream!r} did work in the capture of {self.origin!r} that the origin stream never waited for "
                    "(wait on the asynchronous op's Work, or make the origin stream wait on an event recorded "
                    "after it, before the capture ends)",
                )
        return None

    def restore(self, poison: bool) -> None:
        """Memory the capture wrote back as it was, what it allocated poisoned, the generators as before."""
        with fake_device.inside_double(), torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            for storage, before in self._snapshots.values():
                storage.copy_(before)
            if poison:
                for t in self._allocated.values():
                    _poison(t)
        for generator, state in self._generators.values():
            generator.set_state(state)
        self._snapshots.clear()
        self._allocated.clear()
        self._generators.clear()

    def reset(self) -> None:
        """CUDAGraph.reset: the graph and its executable are destroyed (aten/src/ATen/cuda/CUDAGraph.cpp), and
        with them the NCCL plans it captured (their reclaim lowers the communicators' localPersistentRefs:
        NCCL's src/enqueue.cc, reclaimPlan)."""
        self.entries.clear()
        if self.state in ("captured", "failed"):
            self.state = "reset"
        self.fake.nccl.graph_gone(self)

    # replay -----------------------------------------------------------------------------------------------------
    def replay(self) -> None:
        """cudaGraphLaunch on the calling thread's current stream: the origin stream's work goes there."""
        if self.state == "reset":  # (CUDAGraph::replay: TORCH_CHECK(has_graph_exec_, ...))
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        if self.state != "captured":
            raise RuntimeError(f"replay of a graph that is {self.state}, not captured")
        fake = self.fake
        if fake.capturing is not None and fake.capturing.thread == threading.get_ident():
            raise cuda_error(UNSUPPORTED, "operation not permitted when stream is capturing", "a replay")
        launch = fake.current_stream(sim_gpu.device(self.origin.device_index))
        streams = {self.origin: launch}
        start = fake.event()
        start.record(launch)
        for stream in self.joined:
            if stream is not self.origin:
                streams[stream] = stream
                stream.wait_event(start)  # (the graph's nodes follow the launch stream's earlier work)
        events: dict[int, Any] = {}  # a captured event -> this replay's own (CUDA keeps them internal)
        self.replays += 1
        for entry in self.entries:
            if isinstance(entry, _Aten):
                with fake.on_streams(streams.get(entry.stream, entry.stream)):
                    _run_again(entry)
            elif isinstance(entry, _Nccl):
                entry.nccl.replay_group(entry.queued, streams)
            elif isinstance(entry, _Record):
                event = events[id(entry.event)] = fake.event()
                event.record(streams[entry.stream])
            else:
                replayed = events.get(id(entry.event))
                if replayed is not None:
                    streams[entry.stream].wait_event(replayed)


def _joined_back(graph: FakeGraph, stream: Any, index: int, origin: Any, origin_index: int) -> bool:
    """Does the origin's log at origin_index wait, through captured events, for `stream`'s op at `index`?"""

    def waited_on(s: Any, i: int) -> tuple[Any, int] | None:
        kind, event = graph.joined[s][i]
        return event.captured_at if kind == "wait" and event is not None else None

    return fake_device.follows((stream, index), (origin, origin_index), waited_on)


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype != torch.bool and t.numel():
        t.fill_(torch.iinfo(t.dtype).max)


def _run_again(entry: _Aten) -> None:
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        result = entry.func(*entry.args, **entry.kwargs)
        new, _ = tree_flatten(result)
        for out, value in zip(entry.outs, new):
            if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor) and value is not out:
                if value.data_ptr() == out.data_ptr() and value.stride() == out.stride():
                    continue  # (the same memory: an op that returned an alias)
                out.copy_(value)


_capturing = threading.local()  # .graph: the graph the calling thread captures into, if any


def _optimizer_health_check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch/optim/optimizer.py, Optimizer._accelerator_graph_capture_health_check, for the double's device
    (torch checks the accelerator types cuda and xpu only), in the optimizers whose step() calls it: those with
    a `capturable` option (SGD has none: its step keeps no count on the host)."""
    if (
        getattr(_capturing, "graph", None) is not None
        and "capturable" in optimizer.defaults
        and not all(group["capturable"] for group in optimizer.param_groups)
    ):
        raise RuntimeError(
            f"Attempting CUDA graph capture of step() for an instance of {type(optimizer).__name__} but "
            "param_groups' capturable is False."
        )


_hooks_lock = threading.Lock()
_hooks: list[Any] = []


def _install_optimizer_health_check() -> None:
    with _hooks_lock:
        if not _hooks:
            _hooks.append(register_optimizer_step_pre_hook(_optimizer_health_check))


class CaptureRecorder(TorchDispatchMode):
    """The capturing thread's aten ops: refused if they sync the host, else run and recorded."""

    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()
        self.graph = graph

    @sim_gpu_engine.dispatch_boundary  # (a refusal raised inside the capture's backward: sim_gpu_engine.py)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(fake_device._local, "inside", 0):  # (the double's own work, not the step's)
            return func(*args, **kwargs)
        device, host_tensor = _devices(args, kwargs)
        if device is None:  # host work: not captured, it runs now and never again
            return func(*args, **kwargs)
        graph = self.graph
        stream = graph.fake.current_stream(device)
        if stream.capture is not graph:  # a stream outside the capture: its work runs now, once
            return func(*args, **kwargs)
        name = func.name()
        if host_tensor is not None and func not in _MOVES_DATA:
            raise GraphCaptureError(
                f"a host tensor ({tuple(host_tensor.shape)} {host_tensor.dtype}) is read by {name} on {device} in a "
                "step being captured as a CUDA graph: a device op reads a host value once, when it is launched "
                "(a kernel argument; a fused optimizer's host lr: FusedAdamWKernel.cu reads lr.item()), so the "
                f"graph would replay the value of the capture for ever, at\n  {user_line()}\nMake it a device "
                "tensor (torch.tensor(value, device=device) before the step, updated in place with fill_/copy_)."
            )
        why = _HOST_SYNCS.get(name)
        if why is not None:
            raise GraphCaptureError(
                f"{why} in a step being captured as a CUDA graph: the host cannot wait for the device during "
                f"capture (CUDA: cudaErrorStreamCaptureUnsupported, error 900). The op is {name}, at\n  "
                f"{user_line()}\nKeep the value on the device (torch.where instead of a branch; an optimizer "
                "with capturable=True; no printing), or leave that code out of the graphed step."
            )
        for generator in _generators(func, args, kwargs):
            graph.remember_generator(
                sim_gpu.default_generator(device.index) if generator is None else generator
            )
        schema = func._schema
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        graph.before_write(t)
        result = func(*args, **kwargs)
        outs, _ = tree_flatten(result)
        if not func.is_view and not schema.is_mutable:
            for t in outs:
                if isinstance(t, torch.Tensor):
                    graph.allocated(t)
        if not func.is_view:
            graph.entries.append(_Aten(func, tuple(args), dict(kwargs), outs, stream))
        return result


# The ops whose host tensor arguments are data being moved (a copy), not a value a kernel reads at launch.
_MOVES_DATA = frozenset({torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default})


def _devices(args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.Tensor | None]:
    """The GPU an op runs on (a factory's device, or its first device tensor's), or None for host work; and a host
    tensor among its arguments, if any."""
    made_on = kwargs.get("device")
    device = made_on if isinstance(made_on, torch.device) and made_on.type == sim_gpu.DEVICE_TYPE else None
    host_tensor = None
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                if sim_gpu.is_device(t):
                    device = device or t.device
                elif t.device.type == "cpu" and host_tensor is None:
                    host_tensor = t
    return device, host_tensor


def _generators(func: Any, args: tuple, kwargs: dict):
    for i, argument in enumerate(func._schema.arguments):
        if "Generator" in str(argument.type):
            yield args[i] if i < len(args) else kwargs.get(argument.name)


@contextlib.contextmanager
def capture(fake: Any, graph: FakeGraph, stream: Any, generators: Any = ()):
    """torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local") on the double."""
    if stream.name.startswith("default["):
        raise RuntimeError(
            "CUDA graphs must be captured on a non-default stream. (However, after capture, it's ok to replay "
            "them on the default stream.)"
        )  # aten/src/ATen/cuda/CUDAGraph.cpp, capture_begin
    if graph.state != "new":
        raise RuntimeError("a CUDAGraph can be captured once (make a new one to capture again)")
    _install_optimizer_health_check()
    # (the recorder is the capturing thread's: backward on a device thread would go unseen; graphed_step turns
    # them off for its capture)
    if fake.autograd_thread and torch._C._is_multithreading_enabled():
        raise NotImplementedError(
            "the double's capture does not model backward on autograd's device thread (FakeCuda(autograd_thread="
            "True)); on a GPU its kernels would be captured too. threadpar's rank threads run backward themselves "
            "by default (torch_distributed=True)"
        )
    with fake.lock:
        if fake.capturing is not None:
            raise RuntimeError(
                "only one CUDA graph capture may be underway at a time in a process (torch docs, notes/cuda.rst, "
                "Constraints; c10/cuda/CUDACachingAllocator.cpp asserts captures_underway.empty())"
            )
        if fake.allocator_stuck is not None:
            raise RuntimeError(
                "the caching allocator still has a capture underway: an earlier capture ended with a CUDA error "
                f"({fake.allocator_stuck}) before its pool's allocation ended (CUDAGraph::capture_end throws before "
                "endAllocateToPool), and c10/cuda/CUDACachingAllocator.cpp asserts captures_underway.empty()"
            )
        fake.capturing = graph
    graph.state, graph.origin, graph.thread = "capturing", stream, threading.get_ident()
    stream.capture = graph
    graph.joined[stream] = []
    for generator in generators:
        graph.remember_generator(generator)
    ok = ended = False
    bound = sim_gpu.bind(fake)  # (the capturing thread's copies are this process's: its capture refuses them)
    _capturing.graph = graph
    try:
        with fake.on_streams(stream), CaptureRecorder(graph):
            yield
        ok = True
    finally:
        _capturing.graph = None
        sim_gpu.bind(bound)
        try:
            for joined in graph.joined:
                joined.capture = None
            if ok:
                graph.end()
                ended = True
            else:  # (a failed capture: invalidated, as cudaStreamEndCapture says; memory as before)
                graph.entries.clear()
                graph.restore(poison=False)
                unjoined = graph.unjoined()
                if unjoined is not None:  # (the end of the capture fails too, and that error is what shows)
                    fake.allocator_stuck = f"error {UNJOINED}"
                    raise unjoined
        finally:
            graph.state = "captured" if ended else "failed"
            with fake.lock:
                fake.capturing = None
            if not ended:  # (a capture that failed makes no graph: cudaStreamEndCapture destroys what it
                # captured, releasing the user object NCCL attached to it (src/misc/strongstream.cc,
                # ncclCudaGraphAddDestructor), whose destructor reclaims the plans and lowers the communicators'
                # localPersistentRefs (src/enqueue.cc, persistentDestructor -> reclaimPlan)
                fake.nccl.graph_gone(graph)
