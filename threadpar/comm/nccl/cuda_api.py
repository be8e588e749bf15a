"""Every CUDA and NCCL call threadpar makes, behind two small objects that tests replace with a double.

The nccl backend and the `threads` backend on CUDA tensors never call torch.cuda directly: they call a
`CudaApi` (CUDA primitives: the launch's `World.cuda`, else `torch_cuda()`), and the nccl backend an
`NcclRuntime` on top of it (`nccl_runtime()`: NCCL's C API through library.py), so that tests on a machine
without a GPU can pass tests/fakes/fake_cuda_nccl.py, which records the calls and computes the collectives
on CPU tensors.

The process's instances of what must be process-wide live here (`nccl_runtime()`): the launch lock of each
device (NCCL calls on communicators that share a device must come from one thread at a time, whichever
launch they belong to: resources.DeviceLocks), the comm streams live groups hold, the pool of cliques (a
finished launch hands its healthy cliques back for the next launch on the same devices), and the watchdog
(watchdog.py).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from threadpar.comm.nccl import bootstrap
from threadpar.comm.nccl.library import NcclLibrary, nccl_library
from threadpar.comm.nccl.resources import CliquePool, CommStreams, DeviceLocks
from threadpar.comm.nccl.watchdog import Watchdog
from threadpar.errors import ConfigError, add_note

__all__ = ["LibraryNcclRuntime", "TorchCuda", "nccl_runtime", "torch_cuda"]


class TorchCuda:
    """The real CUDA primitives: torch.cuda streams, events, copies, the device guard (no state of its own)."""

    def pool_stream(self, device: torch.device, priority: int) -> torch.cuda.Stream:
        """One of torch's pooled streams (shared round-robin: use through CommStreams)."""
        return torch.cuda.Stream(device=device, priority=priority)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()  # timing disabled: the cheapest kind to record and wait on

    @contextlib.contextmanager
    def on_streams(self, *streams: torch.cuda.Stream) -> Iterator[None]:
        """Make each stream the calling thread's current stream on its device (later ones win per device)."""
        with contextlib.ExitStack() as stack:
            for stream in streams:
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def device_guard(self, device: torch.device):
        return torch.cuda.device(device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, src_stream, dst_stream) -> None:
        """dst <- src across devices: torch runs the copy on the source device's current stream and fences
        it both ways with the destination device's current stream, so set both to the comm streams."""
        with self.on_streams(src_stream, dst_stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Keep the caching allocator from reusing `tensor`'s memory before `stream` is done with it."""
        tensor.record_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def capture(
        self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, generators: Sequence[torch.Generator]
    ) -> contextlib.AbstractContextManager[Any]:
        """Capture the calling thread's work on `stream` into `graph`; `generators` (CUDA ones) draw anew at
        each replay (CUDAGraph.register_generator_state, torch >= 2.5; the default generator always does).
        capture_error_mode="thread_local": only this thread's unsafe calls break the capture (Megatron's
        full-iteration graphs do the same); threadpar parks its other ranks meanwhile (cuda_graphs/turns.py)."""
        register = getattr(graph, "register_generator_state", None)
        for generator in generators:
            if register is not None and generator.device.type == "cuda":
                register(generator)
        return _ending_its_pool(graph, stream)


@contextlib.contextmanager
def _ending_its_pool(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """torch.cuda.graph(graph, stream, capture_error_mode="thread_local"), whose end of capture, if it fails
    (a capture CUDA invalidated: cudaStreamEndCapture's error, 900 or 904), still ends the pool's allocation:
    CUDAGraph::capture_end (aten/src/ATen/cuda/CUDAGraph.cpp) throws before endAllocateToPool, which would leave
    the caching allocator with a capture underway for the rest of the process. The step's own error, if it
    raised one, is what propagates (the end's failure becomes a note)."""
    capture = torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")
    capture.__enter__()
    try:
        yield
    except BaseException as error:
        try:
            capture.__exit__(type(error), error, error.__traceback__)
        except BaseException as end_error:
            _end_allocation(graph, stream)
            add_note(error, f"ending the CUDA graph capture failed too: {end_error}")
        raise
    try:
        capture.__exit__(None, None, None)
    except BaseException:
        _end_allocation(graph, stream)
        raise


def _end_allocation(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        with contextlib.suppress(RuntimeError):  # (already ended: capture_end got that far)
            end(stream.device.index, graph.pool())


class LibraryNcclRuntime:
    """The real NCCL runtime: the binding of NCCL's C API (library.py), the process's NCCL bookkeeping."""

    def __init__(
        self,
        cuda: TorchCuda,
        device_locks: DeviceLocks,
        cliques: CliquePool,
        streams: CommStreams,
        watchdog: Watchdog,
    ) -> None:
        self.cuda = cuda
        self.device_locks = device_locks
        self.cliques = cliques
        self.streams = streams
        self.watchdog = watchdog
        self._library: NcclLibrary | None = None

    @property
    def nccl(self) -> NcclLibrary:
        """The binding, loaded on first use (raises ConfigError naming the paths tried if none loads). Read
        on every group's creation: kept after the first load (a write-once value, DESIGN.md rule 10's
        allowed case)."""
        library = self._library
        if library is None:
            library = self._library = nccl_library()
        return library

    def nccl_available(self) -> bool:
        """False where NCCL cannot run: no CUDA (CPU-only torch builds, no GPU) or no loadable libnccl."""
        if not torch.cuda.is_available():
            return False
        try:
            nccl_library()
        except (ConfigError, AttributeError):  # AttributeError: a library without NCCL's symbols
            return False
        return True

    def prepare_environment(self) -> None:
        """NCCL's environment before the process's first communicator (bootstrap.prepare_environment)."""
        bootstrap.prepare_environment()


_CUDA = TorchCuda()
_default: list[LibraryNcclRuntime] = []
_default_lock = threading.Lock()


def torch_cuda() -> TorchCuda:
    """The process's real CudaApi (stateless; importing it needs no GPU)."""
    return _CUDA


def nccl_runtime() -> LibraryNcclRuntime:
    """The process's real NcclRuntime (the library itself loads on its first use); its pool of cliques is
    drained at the interpreter's exit, while CUDA is still up (atexit runs before it unloads)."""
    with _default_lock:
        if not _default:
            runtime = LibraryNcclRuntime(_CUDA, DeviceLocks(), CliquePool(), CommStreams(), Watchdog())
            _default.append(runtime)
            atexit.register(release_pooled, runtime.cliques)
        return _default[0]


def release_pooled(pool: CliquePool) -> int:
    """Destroy every communicator the pool kept for a later launch (ncclCommDestroy: NCCL's buffers go back);
    how many. At exit, and whenever a process no longer launches on those GPUs."""
    comms = pool.drain()
    for comm in comms:
        with contextlib.suppress(Exception):  # (one that fails to go must not keep the others)
            comm.destroy()
    return len(comms)
