"""Every CUDA and NCCL call threadpar makes, behind one small object that tests replace with a double.

The nccl backend and the `threads` backend on CUDA tensors never call torch.cuda directly: they call a
`CudaApi` (the launch's `World.cuda`, else `torch_cuda()`), so that tests on a machine without a GPU can pass
tests/fakes/fake_cuda_nccl.py, which records the calls and computes the collectives on CPU tensors.

Two things here are process-wide on purpose, because what they guard is: the launch lock (NCCL calls are not
thread-safe across communicators that share a device, whichever launch they belong to) and the pool of
NCCL communicators (torch never destroys the ones `init_rank` creates, so a finished launch hands its
cliques back for the next launch on the same devices instead of leaking them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

# Streams of higher priority are scheduled first when compute and communication kernels compete;
# torch maps an out-of-range value to the nearest valid priority.
COMM_STREAM_PRIORITY = -1


class CliquePool:
    """NCCL communicators (one clique per group) left by finished launches, keyed by the members' devices."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[str, ...], list[list[Any]]] = {}

    def take(self, devices: tuple[str, ...]) -> list[Any] | None:
        with self._lock:
            free = self._free.get(devices)
            return free.pop() if free else None

    def give_back(self, devices: tuple[str, ...], comms: list[Any]) -> None:
        if any(c is None for c in comms):
            return  # a member never made its communicator: not a usable clique
        with self._lock:
            self._free.setdefault(devices, []).append(list(comms))


class TorchCuda:
    """The real thing: torch.cuda streams and events, torch.cuda.nccl, and NCCL's async-error query."""

    def __init__(self, launch_lock: threading.Lock, cliques: CliquePool) -> None:
        import torch.cuda.nccl as nccl

        self.nccl = nccl
        self.launch_lock = launch_lock
        self.cliques = cliques

    def nccl_available(self) -> bool:
        """False on torch builds without NCCL (CPU-only builds), where torch.cuda.nccl cannot run."""
        return hasattr(torch._C, "_nccl_all_reduce") and hasattr(torch._C, "_nccl_init_rank")

    def comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device, priority=COMM_STREAM_PRIORITY)

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


_LAUNCH_LOCK = threading.Lock()
_CLIQUES = CliquePool()
_default: list[TorchCuda] = []
_default_lock = threading.Lock()


def torch_cuda() -> TorchCuda:
    """The process's real CudaApi (created on first use; importing it needs no GPU)."""
    with _default_lock:
        if not _default:
            _default.append(TorchCuda(_LAUNCH_LOCK, _CLIQUES))
        return _default[0]
