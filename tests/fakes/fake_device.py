"""The double's device: streams that run NCCL kernels only once every rank's matching call has reached them.

What it models (CUDA C Programming Guide, "Streams" and "Events"; NCCL: nccl.h, user guide usage/p2p.html):
- A stream runs what was enqueued on it in order; `cudaStreamWaitEvent` makes it wait for the most recent
  record of an event on another stream. Nothing else orders two streams.
- An NCCL call returns at once (a blocking communicator's call returns once enqueued); its kernel runs when
  it reaches the head of its stream AND every other rank's matching part has reached the head of theirs (a
  collective's kernels wait for each other; a send for its receive). So the *stream* waits for the peers,
  not the host: an event recorded after the call is not complete until they came; a host that synchronizes
  with it blocks.
- Ranks that enqueue matching calls in orders that make each wait for the other (rank 0: A then B on one
  stream, rank 1: B then A) wait for ever on a GPU: the double finds the cycle and fails the calls in it,
  naming them, instead of timing out.
- A kernel runs lazily here: when something needs its result (an event query or synchronize after it, a
  host op on its buffers: `DeviceTouch`). That is a legal CUDA schedule (nothing promises a kernel starts
  before its stream is waited on), and the strictest: a buffer an operation has not run on yet, touched by
  a host op that its stream does not order after the operation, is a race the double reports.

The double computes on CPU tensors, on the host, so a host op that needs a pending kernel's result blocks
the host until the kernel can run (on a GPU the host would go on and the *stream* would wait): a program in
which a peer issues its part only after receiving a message this rank sends after such an op deadlocks
here, reported as a hang, and not on a GPU. threadpar's tests do not do that.

`DeviceTouch` is a TorchDispatchMode on every rank thread of a double's launch: before each aten op it looks
at the op's tensors (by the schema's alias info: written or only read) and, for a buffer of a pending NCCL
operation, waits for it (ordered: the op's stream follows the operation's) or reports the race (not
ordered). Its fast path (nothing pending anywhere) is one dict check.

`TensorRecord`: what the double logs about a tensor, held weakly (torch's record_stream only marks the
allocator's block, keeping no reference: c10/cuda/CUDACachingAllocator.cpp, recordStream).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from . import sim_gpu, sim_gpu_engine

# One lock runs every fake device of every simulated process (a collective spans several FakeCudas);
# CHANGED is notified whenever something a waiting host could need happened (a part issued, an abort).
RUN_LOCK = threading.RLock()
CHANGED = threading.Condition(RUN_LOCK)
# How long a host blocks on the double's device before it says the GPU would wait for ever.
WAIT_TIMEOUT_S = 10.0


class TensorRecord:
    """What the double remembers about a tensor it saw: its address and type, and a weak reference (of a device
    tensor, its memory: sim_gpu.host)."""

    __slots__ = ("_ptr", "_ref", "dtype", "numel", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        tensor = sim_gpu.host(tensor)
        self._ptr = tensor.data_ptr()
        self.dtype, self.shape, self.numel = tensor.dtype, tuple(tensor.shape), tensor.numel()
        self._ref = weakref.ref(tensor)

    def data_ptr(self) -> int:
        return self._ptr

    @property
    def tensor(self) -> torch.Tensor:
        live = self._ref()
        if live is None:
            raise LookupError(
                "the double logged this tensor, which is gone now (its log holds weak references)"
            )
        return live

    def refers_to(self, tensor: torch.Tensor) -> bool:
        return self._ref() is sim_gpu.host(tensor)


class Blocked(NamedTuple):
    """Why a kernel cannot run yet: a peer's part is not there (or the device hangs)."""

    what: str


class HangError(RuntimeError):
    """What the double raises where a GPU would wait for ever."""


# -- operations and kernels ----------------------------------------------------------------------------------------
class DeviceOp:
    """One NCCL operation across ranks (a collective of a clique, or one send matched with one receive):
    done once it ran (or failed: `error`). `parts[rank]` is each rank's Part, once issued."""

    def __init__(self, name: str, size: int, run: Callable[[DeviceOp], str | None]) -> None:
        self.name = name
        self.size = size
        self.parts: dict[int, Part] = {}
        self.done = False
        self.error: str | None = None
        self.hang = False  # its error is a hang on a GPU (a cycle of kernels waiting for each other)
        self._run = run
        self.after: list[Callable[[], None]] = []  # tests: what to do to its results once it ran

    def describe_missing(self) -> str:
        missing = sorted(set(range(self.size)) - set(self.parts))
        return f"{self.name}: NCCL ranks {missing} never issued their part"

    def execute(self) -> None:
        """Compute it (the parts are all at their streams' heads); record what NCCL would get wrong. A kernel
        writes memory below autograd: the tensors' version counters stay as they were (an in-place torch op
        would bump them, and a tensor saved for backward meanwhile, a view of a received message, would then
        look modified). So it writes through aliases of the outputs' memory with version counters of their
        own: a counter reset after the write would race with the receiving rank's autograd, which may save
        the tensor (and its version) between the write and the reset, on its own thread."""
        writing = [p for p in self.parts.values() if p.output is not None]
        outputs = [p.output for p in writing]
        with inside_double(), torch.no_grad():
            for part, output in zip(writing, outputs):
                part.output = _kernel_alias(output)  # type: ignore[arg-type]  # (not None: filtered)
            try:
                self.error = self._run(self)
                for hook in self.after:
                    hook()
            finally:
                for part, output in zip(writing, outputs):
                    part.output = output
        self.finish()

    def fail(self, error: str) -> None:
        if not self.done:
            self.error = self.error or error
            self.finish()

    def finish(self) -> None:
        self.done = True
        for part in self.parts.values():
            unregister(part)
            part.input = part.output = None  # the device is done with them (and a part and its op refer
            # to each other: the tensors must not wait for the garbage collector)
        CHANGED.notify_all()


def _kernel_alias(t: torch.Tensor) -> torch.Tensor:
    """The memory of `t` as a new tensor, with a version counter of its own (what a kernel writes through)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
    )


class Part:
    """One rank's share of a DeviceOp: its kernel, what it reads and what it writes."""

    __slots__ = ("aborted", "comm_key", "fake", "input", "kernel", "op", "output", "rank", "registered")

    def __init__(
        self, op: DeviceOp, rank: int, fake: Any, input: torch.Tensor | None, output: torch.Tensor | None
    ):
        self.op, self.rank, self.fake = op, rank, fake
        self.input, self.output = input, output  # strong references: the device holds them until it runs
        self.kernel: Kernel | None = None
        self.comm_key: Any = None  # whose communicator issued it (the NCCL double's key)
        self.aborted: str | None = None  # its communicator was aborted: its kernel ended, unrun
        self.registered: list[int] = []  # the storages it is a pending access of


class Kernel:
    """What one group end (or one ungrouped call) enqueued on one stream: its parts run together."""

    __slots__ = ("index", "parts", "stream")

    def __init__(self, stream: Any, index: int, parts: list[Part]) -> None:
        self.stream, self.index, self.parts = stream, index, parts

    def __repr__(self) -> str:
        names = ", ".join(f"{p.op.name} (rank {p.rank})" for p in self.parts)
        return f"[{names}] on {self.stream!r}"


class _Cycle(Exception):
    def __init__(self, kernels: list[Kernel]) -> None:
        super().__init__()
        self.kernels = kernels


def advance(stream: Any, upto: int, visiting: list[Kernel] | None = None) -> Blocked | None:
    """Run `stream` up to node `upto` as far as it can; None once there. The caller holds RUN_LOCK."""
    visiting = [] if visiting is None else visiting
    while stream.done_upto < upto:
        index = stream.done_upto + 1
        op = stream.ops[index]
        if op[0] == "wait" and op[2] is not None:
            blocked = advance(op[2].stream, op[2].index, visiting)
            if blocked is not None:
                return blocked
        kernel = stream.kernels.get(index)
        if kernel is not None:
            blocked = _run_kernel(kernel, visiting)
            if blocked is not None:
                return blocked
            del stream.kernels[index]
            # A kernel whose operation failed (what NCCL would get wrong: the double fails it loudly) surfaces
            # at the next synchronization that passes it. (A part its communicator's abort ended just ends, as
            # on a GPU: its buffers hold whatever they hold.)
            failed = next((p.op for p in kernel.parts if p.op.error is not None and p.aborted is None), None)
            if failed is not None:
                stream.failed.append((index, failed.error, HangError if failed.hang else RuntimeError))
        stream.done_upto = index
    return None


def _run_kernel(kernel: Kernel, visiting: list[Kernel]) -> Blocked | None:
    if kernel in visiting:
        raise _Cycle(visiting[visiting.index(kernel) :])
    visiting.append(kernel)
    try:
        for part in kernel.parts:
            op = part.op
            if op.done or part.aborted is not None:
                continue
            if len(op.parts) < op.size:
                return Blocked(op.describe_missing())
            for other in op.parts.values():
                if other.aborted is not None:
                    return Blocked(f"{op.name}: the communicator of its rank {other.rank} was aborted")
                if other.fake.hung:
                    return Blocked(f"{op.name}: the device hangs (FakeCuda.hang)")
                assert other.kernel is not None
                if other.kernel is not kernel:  # the peer's kernel must have reached its stream's head
                    blocked = advance(other.kernel.stream, other.kernel.index - 1, visiting)
                    if blocked is not None:
                        return blocked
            op.execute()
        return None
    finally:
        visiting.pop()


def run_to(stream: Any, upto: int) -> Blocked | None:
    """`advance`, turning a cycle (a hang on a GPU) into the failure of its operations."""
    try:
        return advance(stream, upto)
    except _Cycle as cycle:
        lines = [f"  {kernel!r}" for kernel in cycle.kernels]
        message = (
            "the double's device would hang: these NCCL kernels wait for each other in a cycle (ranks issued "
            "operations of different communicators, or a send and a receive, in orders that make each wait "
            "for the other on its stream; NCCL kernels block until their peers run):\n" + "\n".join(lines)
        )
        for kernel in cycle.kernels:
            for part in kernel.parts:
                part.op.hang = True
                part.op.fail(message)
        raise HangError(message) from None


def query(stream: Any, upto: int) -> bool:
    """cudaEventQuery-like: has the device run `stream` up to `upto`? Never blocks."""
    with RUN_LOCK:
        blocked = run_to(stream, upto)
        _raise_failed(stream, upto)
        return blocked is None


def demand(stream: Any, upto: int, why: str) -> None:
    """The host waits until the device has run `stream` up to `upto` (a synchronize, a host op on a buffer):
    bounded by WAIT_TIMEOUT_S, where a GPU would wait for ever."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    with RUN_LOCK:
        while True:
            blocked = run_to(stream, upto)
            if blocked is None:
                _raise_failed(stream, upto)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HangError(
                    f"{why}: the host waited {WAIT_TIMEOUT_S:g} s on the double's device for {blocked.what} "
                    "(on a GPU it would wait for ever)"
                )
            CHANGED.wait(min(remaining, 0.05))


def _raise_failed(stream: Any, upto: int) -> None:
    """A failed operation the stream ran before `upto` surfaces at the first synchronization that passes it
    (the double's operations fail where NCCL would hang or corrupt data)."""
    for entry in list(stream.failed):
        index, error, kind = entry
        if index <= upto:
            stream.failed.remove(entry)
            raise kind(error)


def enqueue(kernels: list[Kernel], lazy: bool) -> None:
    """The kernels a group end issued, each on its stream (their parts registered with their ops by the
    caller). Unless `lazy`, an operation whose every part is now issued runs at once, as far as its streams
    let it (a GPU may run it then, or as late as something waits for it: `lazy` is that latest schedule,
    which catches more races)."""
    with RUN_LOCK:
        for kernel in kernels:
            kernel.stream.kernels[kernel.index] = kernel
            for part in kernel.parts:
                part.kernel = kernel
                register(part)
        if not lazy:
            for part in [p for kernel in kernels for p in kernel.parts]:
                if len(part.op.parts) == part.op.size and all(
                    o.kernel is not None for o in part.op.parts.values()
                ):
                    for other in list(part.op.parts.values()):
                        # (a hang fails its operations: the streams' synchronizations say so)
                        with contextlib.suppress(HangError):
                            run_to(other.kernel.stream, other.kernel.index)  # type: ignore[union-attr]
        CHANGED.notify_all()


def follows(a: tuple[Any, int], b: tuple[Any, int], waited_on: Callable[[Any, int], Any]) -> bool:
    """Does node b (stream, index) come after node a, through its stream's order and the events it waited
    on? `waited_on(stream, index)`: the node a wait at that index waits for, or None (not a wait)."""
    a_stream, a_index = a
    stack, seen = [b], set()
    while stack:
        stream, index = stack.pop()
        if stream is a_stream and index >= a_index:
            return True
        if index < 0 or (id(stream), index) in seen:
            continue
        seen.add((id(stream), index))
        stack.append((stream, index - 1))
        source = waited_on(stream, index)
        if source is not None:
            stack.append(source)
    return False


def ordered(a: tuple[Any, int], b: tuple[Any, int]) -> bool:
    """Would CUDA finish node a (stream, index) before starting node b? Stream order, plus waits on events."""

    def waited_on(stream: Any, index: int) -> tuple[Any, int] | None:
        op = stream.ops[index]
        return (op[2].stream, op[2].index) if op[0] == "wait" and op[2] is not None else None

    return follows(a, b, waited_on)


# -- pending buffers and the host's touches ------------------------------------------------------------------------
class _Access(NamedTuple):
    start: int
    end: int
    write: bool
    part: Part


_PENDING: dict[int, list[_Access]] = {}  # storage address -> the pending NCCL parts that read or write it


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of what `t` can touch."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    try:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:  # (freed: FSDP2 resizes an unsharded parameter's storage to 0 bytes)
            return None
        address = storage.data_ptr()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage: its inner tensors come through later
        return None
    size = t.element_size()
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.storage_offset() * size
    return address, start, start + extent * size


def register(part: Part) -> None:
    for tensor, write in ((part.input, False), (part.output, True)):
        span = None if tensor is None else _span(tensor)
        if span is not None:
            ptr, start, end = span
            _PENDING.setdefault(ptr, []).append(_Access(start, end, write, part))
            part.registered.append(ptr)


def unregister(part: Part) -> None:
    for ptr in part.registered:
        kept = [a for a in _PENDING.get(ptr, ()) if a.part is not part]
        if kept:
            _PENDING[ptr] = kept
        else:
            _PENDING.pop(ptr, None)
    part.registered = []


_local = threading.local()


class inside_double:
    """The double's own torch ops (computing a collective) are not the host's: DeviceTouch lets them be."""

    def __enter__(self) -> None:
        _local.inside = getattr(_local, "inside", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.inside -= 1


def active_touch() -> DeviceTouch | None:
    """The DeviceTouch the calling thread runs under, if any."""
    stack = getattr(_local, "touches", None)
    return stack[-1] if stack else None


# aten ops that read no element of their tensor arguments (their outputs are new tensors, or views)
_METADATA = frozenset(
    f"aten::{name}"
    for name in (
        "empty_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "zeros_like",
        "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "detach", "alias", "lift_fresh",
        "record_stream", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_has_same_storage_numel",
    )
)  # fmt: skip


# The namespaces of torch.distributed's ops: their ordering with the device is the backend's own business
# (they call threadpar's process group, whose Works order the streams: c10d's collectives, functional
# collectives and their wait_tensor).
_COMMUNICATION = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")


def _touches_data(func: Any) -> bool:
    name = func.name()
    return not (func.is_view or name in _METADATA or name.startswith(_COMMUNICATION))


# func -> its arguments that may hold tensors: (position, name, written), or None for an op that reads no data
_ARGUMENTS: dict[Any, tuple[tuple[int, str, bool], ...] | None] = {}


def _tensor_arguments(func: Any) -> tuple[tuple[int, str, bool], ...] | None:
    found = _ARGUMENTS.get(func, ())
    if found != ():
        return found
    if not _touches_data(func):
        found = None
    else:
        found = tuple(
            (i, a.name, a.alias_info is not None and a.alias_info.is_write)
            for i, a in enumerate(func._schema.arguments)
            if "Tensor" in str(a.type)
        )
    _ARGUMENTS[func] = found  # (a dict store: a race only computes it twice)
    return found


def host_read(t: torch.Tensor) -> None:
    """A host read that bypasses the dispatcher (Tensor.tolist, .numpy(): they read CPU memory directly, as
    a GPU tensor's would be copied first): checked as an aten op reading `t` would be."""
    touch = active_touch()
    if touch is not None and _PENDING and not getattr(_local, "inside", 0):
        touch._touch_named("a host read (tolist/numpy)", t, False, None)


_patch_lock = threading.Lock()
_patched = [0]  # launches of the double running (nested and concurrent launches share one patch)
_originals: dict[str, Any] = {}


class watch_host_reads:
    """While open, Tensor.tolist and Tensor.numpy check their tensor as DeviceTouch checks an aten op (they
    read memory without dispatching one): process-wide, counted, so concurrent launches share the patch."""

    def __enter__(self) -> None:
        with _patch_lock:
            if _patched[0] == 0:
                for name in ("tolist", "numpy"):
                    original = _originals[name] = getattr(torch.Tensor, name)
                    setattr(torch.Tensor, name, _reading(original))
            _patched[0] += 1

    def __exit__(self, *exc: object) -> None:
        with _patch_lock:
            _patched[0] -= 1
            if _patched[0] == 0:
                for name, original in _originals.items():
                    setattr(torch.Tensor, name, original)


def _reading(original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        host_read(self)
        return original(self, *args, **kwargs)

    return read


def check_device_op(func: Any, args: tuple, kwargs: dict) -> None:
    """sim_gpu's check of every op on device tensors (sim_gpu._op_check): a device op whose stream is ordered
    after a pending operation on its buffers waits for it (the double runs ops at once, on the host: a GPU's
    stream would wait), one that is not ordered is a race, reported to the thread's FakeCuda (its copy model:
    run_fake_gpus and simulated_gpus bind one). The device tensors' half of DeviceTouch, which run_fake_gpus
    adds for host tensors (an asynchronous copy's pinned memory)."""
    if not _PENDING or getattr(_local, "inside", 0):
        return
    fake = sim_gpu.bound()
    if fake is None:
        return
    arguments = _tensor_arguments(func)
    if arguments:
        _OpTouch(fake)._check(func, arguments, args, kwargs)


class _Touches:
    """What DeviceTouch and check_device_op share: the checks of an op's tensors against pending operations."""

    fake: Any
    _streams: Callable[[torch.device], Any]
    devices_here = True  # device tensors are checked here (False: by the device's dispatch, check_device_op)

    def _check(self, func: Any, arguments: tuple, args: tuple, kwargs: dict) -> None:
        for i, name, write in arguments:
            value = args[i] if i < len(args) else kwargs.get(name)
            tensors = value if isinstance(value, (list, tuple)) else (value,)
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self._touch(func, t, write)

    def _touch(self, func: Any, t: torch.Tensor, write: bool) -> None:
        if sim_gpu.is_device(t):
            if self.devices_here:
                self._touch_named(func.name(), sim_gpu.host(t), write, t.device)
            return
        if is_traceable_wrapper_subclass(
            t
        ):  # (DTensor, AsyncCollectiveTensor: what they hold is read; the op
            # they dispatch again with it runs below this mode, unseen)
            names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            for name in names:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._touch(func, inner, write)
            return
        self._touch_named(func.name(), t, write, None)

    def _touch_named(self, what: str, t: torch.Tensor, write: bool, device: torch.device | None) -> None:
        """`t` is the memory touched (a host tensor); `device`, the GPU whose op touches it (its current stream
        orders the op), or None for the host itself, which is ordered after a pending operation only once it
        synchronized with it (and then the operation has run)."""
        span = _span(t)
        if span is None:
            return
        ptr, start, end = span
        if ptr not in _PENDING:  # (a dict read: the common case, no lock)
            return
        with RUN_LOCK:
            accesses = [
                a for a in _PENDING.get(ptr, ()) if a.start < end and start < a.end and (a.write or write)
            ]
            for access in accesses:
                part = access.part
                if part.op.done or part.kernel is None:
                    continue
                kernel = part.kernel
                stream = None if device is None else self._streams(device)
                if stream is not None and (
                    stream is kernel.stream
                    or ordered((kernel.stream, kernel.index), (stream, len(stream.ops) - 1))
                ):
                    demand(kernel.stream, kernel.index, f"{what} on a buffer of {part.op.name}")
                    continue
                where = (
                    f"{stream!r}" if stream is not None else "the host (which did not synchronize with it)"
                )
                message = (
                    f"race: {what} {'writes' if write else 'reads'} a buffer that {part.op.name} "
                    f"{'writes' if access.write else 'reads'} on {kernel.stream!r}, which has not run yet and is "
                    f"not ordered before {where} (a GPU would read or clobber it depending on timing): wait "
                    "on the operation's Work (or its stream) before touching its buffers"
                )
                self.fake.report_race(message)
                raise RuntimeError(message)


class _OpTouch(_Touches):
    def __init__(self, fake: Any) -> None:
        self.fake, self._streams = fake, fake.current_stream


class DeviceTouch(_Touches, TorchDispatchMode):
    """On a rank thread of a double's launch: a host op on the buffer of a pending operation (an asynchronous
    copy's pinned memory) waits for it if ordered, and is a race otherwise (see the module docstring); device
    tensors are the device's dispatch's to check (check_device_op)."""

    devices_here = False

    def __init__(self, fake: Any, streams: Callable[[torch.device], Any]) -> None:
        super().__init__()
        self.fake = fake
        self._streams = streams  # device -> the current stream of the thread the mode stands for

    def __enter__(self) -> DeviceTouch:
        stack = getattr(_local, "touches", None)
        if stack is None:
            stack = _local.touches = []
        stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _local.touches.pop()
        super().__exit__(*exc)

    def again(self) -> DeviceTouch:
        """The same watch for another thread (a rank's autograd device thread)."""
        return DeviceTouch(self.fake, self._streams)

    @sim_gpu_engine.dispatch_boundary  # (an error raised into autograd's engine: sim_gpu_engine.py)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _PENDING and not getattr(_local, "inside", 0):
            arguments = _tensor_arguments(func)
            if arguments:
                self._check(func, arguments, args, kwargs)
        return func(*args, **kwargs)


sim_gpu._op_check.append(check_device_op)
