"""Every CUDA and NCCL call threadpar makes, behind two small objects that tests replace with a double.

The nccl backend and the `threads` backend on CUDA tensors never call torch.cuda directly: they call a
`CudaApi` (CUDA primitives: the launch's `World.cuda`, else `torch_cuda()`), and the nccl backend an
`NcclRuntime` on top of it (`torch_nccl()`), so that tests on a machine without a GPU can pass
tests/fakes/fake_cuda_nccl.py, which records the calls and computes the collectives on CPU tensors.

The process's instances of what must be process-wide live here (`torch_nccl()`): the launch lock (NCCL calls
are not thread-safe across communicators that share a device, whichever launch they belong to) and the
bookkeeping in resources.py: the pool of cliques (torch never destroys the communicators `init_rank`
creates, so a finished launch hands its cliques back for the next launch on the same devices), the comm
streams live groups hold, the devices whose communicators are being created.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from threadpar.comm.nccl.resources import CliqueHealth, CliquePool, CommStreams, DeviceInits

# The process-wide bookkeeping (re-exported: the double and the tests import them from here too).
__all__ = [
    "CliqueHealth",
    "CliquePool",
    "CommStreams",
    "DeviceInits",
    "TorchCuda",
    "TorchNcclRuntime",
    "torch_cuda",
    "torch_nccl",
]


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


class TorchNcclRuntime:
    """The real NCCL runtime: torch.cuda.nccl, the process's NCCL bookkeeping, NCCL's async-error query."""

    def __init__(
        self,
        cuda: TorchCuda,
        launch_lock: threading.Lock,
        cliques: CliquePool,
        inits: DeviceInits,
        streams: CommStreams,
    ) -> None:
        import torch.cuda.nccl as nccl

        self.cuda = cuda
        self.nccl = nccl
        self.launch_lock = launch_lock
        self.cliques = cliques
        self.inits = inits
        self.streams = streams

    def nccl_available(self) -> bool:
        """False on torch builds without NCCL (CPU-only builds), where torch.cuda.nccl cannot run."""
        return hasattr(torch._C, "_nccl_all_reduce") and hasattr(torch._C, "_nccl_init_rank")

    def async_error(self, comm: Any) -> str | None:
        """NCCL's asynchronous error of a communicator (ncclCommGetAsyncError), or None if all is well or the
        query is unavailable (torch.cuda.nccl does not expose it; it is reached through the loaded libnccl)."""
        query = _async_error_query()
        return None if query is None else query(comm)


def _find_nccl_symbols() -> tuple[Any, Any] | None:
    # Only the NCCL that torch already loaded will do (a communicator must go back to the library that made
    # it), so never load one: RTLD_NOLOAD returns a library only if it is in the process already.
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for name in ("libnccl.so.2", "libnccl.so", "libtorch_cuda.so"):
        try:
            lib = ctypes.CDLL(name, mode=mode)
            return lib.ncclCommGetAsyncError, lib.ncclGetErrorString
        except (OSError, AttributeError):
            continue
    return None


_query_lock = threading.Lock()
_query: list[Any] = []  # [] until looked up once, then [callable or None]


def _async_error_query():
    with _query_lock:
        if not _query:
            _query.append(_make_async_error_query())
        return _query[0]


def _make_async_error_query():
    symbols = _find_nccl_symbols()
    if symbols is None:
        return None
    get_async_error, get_error_string = symbols
    get_async_error.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    get_async_error.restype = ctypes.c_int
    get_error_string.argtypes = [ctypes.c_int]
    get_error_string.restype = ctypes.c_char_p
    capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule_pointer.restype = ctypes.c_void_p

    def query(comm: Any) -> str | None:
        pointer = capsule_pointer(comm, b"torch.cuda.nccl.Communicator")
        result = ctypes.c_int(0)
        status = get_async_error(pointer, ctypes.byref(result))
        code = result.value if status == 0 else status
        if code in (0, 7):  # ncclSuccess, ncclInProgress (a non-blocking communicator still working)
            return None
        return f"NCCL error {code}: {get_error_string(code).decode(errors='replace')}"

    return query


_CUDA = TorchCuda()
_LAUNCH_LOCK = threading.Lock()
_CLIQUES = CliquePool()
_INITS = DeviceInits()
_STREAMS = CommStreams()
_default: list[TorchNcclRuntime] = []
_default_lock = threading.Lock()


def torch_cuda() -> TorchCuda:
    """The process's real CudaApi (stateless; importing it needs no GPU)."""
    return _CUDA


def torch_nccl() -> TorchNcclRuntime:
    """The process's real NcclRuntime (created on first use: it imports torch.cuda.nccl)."""
    with _default_lock:
        if not _default:
            _default.append(TorchNcclRuntime(_CUDA, _LAUNCH_LOCK, _CLIQUES, _INITS, _STREAMS))
        return _default[0]
