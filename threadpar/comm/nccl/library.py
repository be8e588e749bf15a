"""A small typed binding of NCCL's C API (nccl.h), over the libnccl that torch already loaded.

Why not torch.cuda.nccl: its communicator creation, `init_rank`, parses the unique id with the `s#` format
without PY_SSIZE_T_CLEAN (torch/csrc/cuda/python_nccl.cpp, THCPModule_nccl_init_rank), which CPython 3.10
to 3.12 reject with SystemError (pytorch#38019, open since 2020): on the Pythons most users have, no
communicator can be made through it. Its collectives also size and index by the caller's local list (no
root for broadcast, no cross-process all_gather or reduce_scatter at their own bytes, no send/recv).

Why ctypes and not NVIDIA's nccl4py: ctypes is in the standard library, reaches the very library torch
loaded (a communicator must go back to the library that made it; two NCCLs in one process would each
have their own bootstrap and device state), and a CDLL call releases the GIL for its whole duration
(ctypes' _ctypes_callproc), so a call that blocks in NCCL (an init waiting for its peers, a group end)
never stops the other rank threads. vLLM's pynccl_wrapper.py binds NCCL the same way.

Which library: $THREADPAR_NCCL_LIBRARY if set (a path or a soname), else the one torch loaded: libtorch_cuda
links libnccl.so.2 with an RPATH to nvidia/nccl/lib in the wheel, so after `import torch` (and CUDA's
first use) `ctypes.CDLL("libnccl.so.2")` returns that same copy; then nvidia.nccl's lib folder, then
libnccl.so. When none loads the error names every path tried.

Signatures and enum values are nccl.h's (NCCL 2.18+): ncclResult_t, ncclDataType_t, ncclRedOp_t, the
128-byte ncclUniqueId passed BY VALUE to ncclCommInitRank. Every function here maps to one C function;
tensors become (pointer, count, ncclDataType_t) and streams their cudaStream_t.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from threadpar.comm.nccl.library_copies import check_one_nccl, defining_file, mapped_nccl_files, read_maps
from threadpar.errors import ConfigError, NcclError

LIBRARY_VARIABLE = "THREADPAR_NCCL_LIBRARY"
UNIQUE_ID_BYTES = 128  # nccl.h: #define NCCL_UNIQUE_ID_BYTES 128

# ncclResult_t (nccl.h)
SUCCESS, IN_PROGRESS = 0, 7
RESULT_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}  # fmt: skip

# ncclDataType_t (nccl.h): ncclUint32 = 3 and ncclUint64 = 5 since NCCL 2.x; fp8 (ncclFloat8e4m3 = 10,
# ncclFloat8e5m2 = 11) first in nccl.h of v2.24.3 (absent in v2.23.4), reductions on sm_90+ only.
DATA_TYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4, torch.uint64: 5,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10,
    torch.float8_e5m2: 11,
}  # fmt: skip
FP8_VERSION = (2, 24)
# ncclRedOp_t (nccl.h): ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg (2.10+); no bitwise reductions.
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


# ncclConfig_t (nccl.h, since 2.14): its first four fields are the same in every version since; NCCL copies
# min(size, sizeof(its ncclConfig_t)) bytes over its defaults and resets the fields newer than `version`
# (src/init.cc, parseCommConfig), so this prefix, version 2.14.0, sets `blocking` alone on every version.
CONFIG_MAGIC = 0xCAFEBEEF  # nccl.h: NCCL_API_MAGIC
CONFIG_VERSION = 21400  # NCCL_VERSION(2, 14, 0)
NONBLOCKING_VERSION = (2, 14)


class _Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
    ]


@dataclass(frozen=True)
class Communicator:
    """An ncclComm_t and what it was made for (`handle` is the C pointer)."""

    handle: int
    rank: int
    size: int
    device: int  # the CUDA device index it is bound to


def data_type(dtype: torch.dtype, version: tuple[int, ...] = (99,)) -> int:
    """The ncclDataType_t of `dtype`; bool travels as uint8 (data movement only: the backend never reduces
    bool through NCCL, see reduction.py)."""
    if dtype == torch.bool:
        return DATA_TYPES[torch.uint8]
    code = DATA_TYPES.get(dtype)
    if code is None or (code >= 10 and tuple(version[:2]) < FP8_VERSION):
        raise NcclError(f"NCCL has no data type for {dtype} (ncclDataType_t in nccl.h, NCCL {version})")
    return code


def candidate_paths() -> list[str]:
    """Where to look for libnccl, in order (see the module docstring)."""
    override = os.environ.get(LIBRARY_VARIABLE)
    if override:
        return [override]
    paths = ["libnccl.so.2"]
    with contextlib.suppress(ImportError):
        import nvidia.nccl  # type: ignore[import-not-found]  # the wheel torch's CUDA build depends on

        for folder in getattr(nvidia.nccl, "__path__", []):
            paths.append(os.path.join(folder, "lib", "libnccl.so.2"))
    paths.append("libnccl.so")
    return paths


def load_library() -> ctypes.CDLL:
    """The NCCL shared library (raises ConfigError naming every path tried)."""
    tried = []
    for path in candidate_paths():
        try:
            return ctypes.CDLL(path)
        except OSError as error:
            tried.append(f"{path} ({error})")
    hint = (
        f"{LIBRARY_VARIABLE} names it"
        if os.environ.get(LIBRARY_VARIABLE)
        else f"set {LIBRARY_VARIABLE} to the path of libnccl.so.2, or install a CUDA build of torch"
    )
    raise ConfigError(f"no NCCL library could be loaded; tried: {'; '.join(tried)}. {hint}")


_c_int, _p, _size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
# name -> argtypes (every function returns ncclResult_t, except ncclGetErrorString / ncclGetLastError)
_SIGNATURES: dict[str, list[Any]] = {
    "ncclGetVersion": [ctypes.POINTER(_c_int)],
    "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_p), _c_int, _UniqueId, _c_int],
    "ncclCommInitRankConfig": [ctypes.POINTER(_p), _c_int, _UniqueId, _c_int, ctypes.POINTER(_Config)],
    "ncclCommInitAll": [ctypes.POINTER(_p), _c_int, ctypes.POINTER(_c_int)],
    "ncclCommDestroy": [_p],
    "ncclCommAbort": [_p],
    "ncclCommGetAsyncError": [_p, ctypes.POINTER(_c_int)],
    "ncclAllReduce": [_p, _p, _size, _c_int, _c_int, _p, _p],
    "ncclBroadcast": [_p, _p, _size, _c_int, _c_int, _p, _p],
    "ncclReduce": [_p, _p, _size, _c_int, _c_int, _c_int, _p, _p],
    "ncclAllGather": [_p, _p, _size, _c_int, _p, _p],
    "ncclReduceScatter": [_p, _p, _size, _c_int, _c_int, _p, _p],
    "ncclSend": [_p, _size, _c_int, _c_int, _p, _p],
    "ncclRecv": [_p, _size, _c_int, _c_int, _p, _p],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    # (op out, scalar, ncclDataType_t, ncclScalarResidence_t, comm): NCCL 2.11+
    "ncclRedOpCreatePreMulSum": [ctypes.POINTER(_c_int), _p, _c_int, _c_int, _p],
    "ncclRedOpDestroy": [_c_int, _p],
}
# Functions an older NCCL lacks: the methods that need them refuse with the version that brought them.
_OPTIONAL = {"ncclCommInitRankConfig": "2.14", "ncclRedOpCreatePreMulSum": "2.11", "ncclRedOpDestroy": "2.11"}
SCALAR_HOST_IMMEDIATE = 1  # ncclScalarResidence_t (nccl.h): the scalar is read from host memory at the call


def _stream_handle(stream: Any) -> int:
    """A torch.cuda.Stream's cudaStream_t (0: the legacy default stream)."""
    return int(stream.cuda_stream) if stream is not None else 0


class NcclLibrary:
    """NCCL's C API, one method per C function; raises NcclError on any result but ncclSuccess."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self.lib = load_library() if lib is None else lib
        self._fn: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name, None)
            if fn is None and name in _OPTIONAL:
                continue  # an older NCCL (comm_init_rank_config, red_op_create_pre_mul_sum refuse)
            if fn is None:
                raise AttributeError(f"{name} is missing from the NCCL library")
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fn[name] = fn
        self._error_string = self.lib.ncclGetErrorString
        self._error_string.argtypes, self._error_string.restype = [ctypes.c_int], ctypes.c_char_p
        self._last_error = getattr(self.lib, "ncclGetLastError", None)  # NCCL 2.13+
        if self._last_error is not None:
            self._last_error.argtypes, self._last_error.restype = [_p], ctypes.c_char_p
        number = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(number))
        code = number.value  # nccl.h NCCL_VERSION: X*10000 + Y*100 + Z since 2.9 (X*1000 + Y*100 + Z before)
        self._version = (
            (code // 10000, code // 100 % 100, code % 100)
            if code >= 20900
            else (code // 1000, code // 100 % 10, code % 100)
        )

    # errors -----------------------------------------------------------------------------------------------------
    def error_string(self, code: int) -> str:
        return (self._error_string(code) or b"").decode(errors="replace")

    def _call(self, name: str, *args: Any, comm: int | None = None) -> int:
        """The C call; raises NcclError on any result but ncclSuccess and ncclInProgress (a nonblocking
        communicator's call that goes on in the background: poll ncclCommGetAsyncError, nccl.h)."""
        code = self._fn[name](*args)
        if code not in (SUCCESS, IN_PROGRESS):
            raise self._error(name, code, comm)
        return code

    def _error(self, name: str, code: int, comm: int | None) -> NcclError:
        detail = ""
        if self._last_error is not None:
            last = (self._last_error(comm) or b"").decode(errors="replace").strip()
            detail = f"; last error: {last}" if last else ""
        label = RESULT_NAMES.get(code, f"ncclResult_t {code}")
        return NcclError(f"{name} failed: {label} ({self.error_string(code)}){detail}")

    # version, communicators -------------------------------------------------------------------------------------
    def version(self) -> tuple[int, int, int]:
        return self._version

    def get_unique_id(self) -> bytes:
        uid = _UniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid.internal)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, device: int) -> Communicator:
        """ncclCommInitRank on the calling thread's current CUDA device (set to `device` here): blocks until
        all `nranks` ranks have called it with the same id (nccl.h)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = _p()
        with torch.cuda.device(device):
            self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        return Communicator(int(comm.value or 0), rank, nranks, device)

    def comm_init_rank_config(
        self, nranks: int, unique_id: bytes, rank: int, device: int, blocking: bool
    ) -> Communicator:
        """ncclCommInitRankConfig with `blocking` set: a nonblocking one returns at once (ncclInProgress) and
        is ready once ncclCommGetAsyncError says ncclSuccess (nccl.h; NCCL >= 2.14)."""
        self._require("ncclCommInitRankConfig")  # (nonblocking communicators)
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        config = _Config(ctypes.sizeof(_Config), CONFIG_MAGIC, CONFIG_VERSION, 1 if blocking else 0)
        comm = _p()
        with torch.cuda.device(device):
            self._call("ncclCommInitRankConfig", ctypes.byref(comm), nranks, uid, rank, ctypes.byref(config))
        return Communicator(int(comm.value or 0), rank, nranks, device)

    def comm_init_all(self, devices: Sequence[int]) -> list[Communicator]:
        """ncclCommInitAll: one communicator per device of this process, in one call (rank i on devices[i])."""
        n = len(devices)
        comms = (_p * n)()
        ids = (_c_int * n)(*devices)
        self._call("ncclCommInitAll", comms, n, ids)
        return [Communicator(int(comms[i] or 0), i, n, d) for i, d in enumerate(devices)]

    def comm_destroy(self, comm: Communicator) -> None:
        self._call("ncclCommDestroy", _p(comm.handle), comm=comm.handle)

    def comm_abort(self, comm: Communicator) -> None:
        """ncclCommAbort: frees the communicator and ends its operations still queued or running."""
        self._call("ncclCommAbort", _p(comm.handle), comm=comm.handle)

    def comm_get_async_error(self, comm: Communicator) -> int:
        result = _c_int(0)
        self._call("ncclCommGetAsyncError", _p(comm.handle), ctypes.byref(result), comm=comm.handle)
        return result.value

    # user-created reductions -------------------------------------------------------------------------------------
    def red_op_create_pre_mul_sum(self, scalar: float, dtype: torch.dtype, comm: Communicator) -> int:
        """ncclRedOpCreatePreMulSum with ncclScalarHostImmediate: an ncclRedOp_t of `comm` alone, for `dtype`
        alone, that multiplies each input by `scalar` (held in `dtype`: NCCL copies ncclTypeSize(datatype)
        bytes from the pointer, src/enqueue.cc) before the sum."""
        self._require("ncclRedOpCreatePreMulSum")
        held = torch.tensor([scalar], dtype=dtype)  # the value in `dtype`, on the host
        value = ctypes.create_string_buffer(ctypes.string_at(held.data_ptr(), held.element_size()))
        op = _c_int()
        args = (
            ctypes.byref(op),
            ctypes.cast(value, _p),
            data_type(dtype, self._version),
            SCALAR_HOST_IMMEDIATE,
        )
        self._call("ncclRedOpCreatePreMulSum", *args, _p(comm.handle), comm=comm.handle)
        return op.value

    def red_op_destroy(self, op: int, comm: Communicator) -> None:
        """ncclRedOpDestroy: allowed once the last call given `op` has returned (nccl.h)."""
        self._require("ncclRedOpDestroy")
        self._call("ncclRedOpDestroy", op, _p(comm.handle), comm=comm.handle)

    def _require(self, name: str) -> None:
        if name not in self._fn:
            raise NcclError(f"NCCL {self._version} has no {name} (NCCL {_OPTIONAL[name]}+)")

    # groups -----------------------------------------------------------------------------------------------------
    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> int:
        """ncclGroupEnd: ncclSuccess, or ncclInProgress when a nonblocking communicator's calls go on."""
        return self._call("ncclGroupEnd")

    # collectives and point to point (count and type from the tensors) -------------------------------------------
    def all_reduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: Communicator, stream: Any
    ) -> None:
        args = (send.data_ptr(), recv.data_ptr(), send.numel(), self._type(send), op)
        self._call("ncclAllReduce", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def broadcast(
        self, send: torch.Tensor, recv: torch.Tensor, root: int, comm: Communicator, stream: Any
    ) -> None:
        args = (send.data_ptr(), recv.data_ptr(), recv.numel(), self._type(recv), root)
        self._call("ncclBroadcast", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def reduce(
        self,
        send: torch.Tensor,
        recv: torch.Tensor | None,
        root: int,
        op: int,
        comm: Communicator,
        stream: Any,
    ) -> None:
        """`recv` matters on the root only (NCCL ignores it elsewhere: None)."""
        out = 0 if recv is None else recv.data_ptr()
        args = (send.data_ptr(), out, send.numel(), self._type(send), op, root)
        self._call("ncclReduce", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor, comm: Communicator, stream: Any) -> None:
        """recv holds comm.size x send.numel() elements, rank r's at r x send.numel()."""
        args = (send.data_ptr(), recv.data_ptr(), send.numel(), self._type(send))
        self._call("ncclAllGather", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: Communicator, stream: Any
    ) -> None:
        """send holds comm.size x recv.numel() elements; rank r gets the reduction of block r."""
        args = (send.data_ptr(), recv.data_ptr(), recv.numel(), self._type(recv), op)
        self._call("ncclReduceScatter", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def send(self, tensor: torch.Tensor, peer: int, comm: Communicator, stream: Any) -> None:
        args = (tensor.data_ptr(), tensor.numel(), self._type(tensor), peer)
        self._call("ncclSend", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def recv(self, tensor: torch.Tensor, peer: int, comm: Communicator, stream: Any) -> None:
        args = (tensor.data_ptr(), tensor.numel(), self._type(tensor), peer)
        self._call("ncclRecv", *args, _p(comm.handle), _stream_handle(stream), comm=comm.handle)

    def _type(self, tensor: torch.Tensor) -> int:
        return data_type(tensor.dtype, self._version)


def async_error_text(api: Any, comm: Any) -> str | None:
    """What ncclCommGetAsyncError reports for `comm` through `api` (the binding or the double), or None if
    all is well (ncclInProgress: a non-blocking communicator still working)."""
    code = api.comm_get_async_error(comm)
    if code in (SUCCESS, IN_PROGRESS):
        return None
    return f"NCCL error {code}: {api.error_string(code)}"


@contextlib.contextmanager
def nccl_group(api: Any) -> Iterator[None]:
    """ncclGroupStart ... ncclGroupEnd around the calls made inside (on the real binding or the double).
    NCCL needs the end even after an error inside the group (the group's state is the thread's: nccl.h,
    ncclGroupStart); an error of the end itself is raised only if nothing else was."""
    api.group_start()
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            api.group_end()
        raise
    api.group_end()


_library_lock = threading.Lock()
_library: list[NcclLibrary] = []


def nccl_library() -> NcclLibrary:
    """The process's binding (loaded on first use; raises ConfigError when no NCCL loads, or when it is not the
    NCCL torch uses)."""
    with _library_lock:
        if not _library:
            library = NcclLibrary()
            check_same_nccl_as_torch(library.version(), torch_nccl_version())
            # (the same version in another file is another NCCL too: library_copies.py)
            check_one_nccl(defining_file(library.lib.ncclGetVersion), mapped_nccl_files(read_maps()))
            _library.append(library)
        return _library[0]


def torch_nccl_version() -> tuple[int, ...] | None:
    """The version of the NCCL torch was built with and loaded (torch.cuda.nccl.version()), or None: no NCCL
    in this torch."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(int(v) for v in version) if isinstance(version, tuple) else None


def check_same_nccl_as_torch(loaded: tuple[int, ...], torch_version: tuple[int, ...] | None) -> None:
    """threadpar must call the NCCL torch loaded: two NCCLs in one process each have their own bootstrap and
    device state, and a communicator must go back to the library that made it (torch's own collectives, and
    torch's CUDA graphs' NCCL plans, would belong to the other). A version that differs means another copy."""
    if torch_version is None or tuple(loaded[:3]) == tuple(torch_version[:3]):
        return
    given = os.environ.get(LIBRARY_VARIABLE)
    where = f"{LIBRARY_VARIABLE}={given!r}" if given else "the first libnccl this process found"
    loaded_text = ".".join(map(str, loaded[:3]))
    torch_text = ".".join(map(str, torch_version[:3]))
    raise ConfigError(
        f"threadpar loaded NCCL {loaded_text} ({where}), but torch {torch.__version__} uses NCCL {torch_text}: "
        "two NCCLs in one process do not share communicators or state; "
        + (
            f"unset {LIBRARY_VARIABLE} (threadpar then binds torch's copy) or point it at NCCL {torch_text}"
            if given
            else f"set {LIBRARY_VARIABLE} to the path of torch's libnccl.so.2 (NCCL {torch_text})"
        )
    )
