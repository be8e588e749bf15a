"""The CUDA and NCCL calls the backends make, as two seams a test double can stand in for.

`CudaApi`: CUDA primitives (streams from torch's pool, the current stream, events, stream-ordered copies,
the device guard, synchronisation); what the `threads` backend needs to order its work on CUDA tensors
with the callers' streams. `NcclRuntime`: the NCCL library and the process's NCCL state on top of them
(the NCCL C API, each device's launch lock, the pool of communicator cliques, the comm streams live groups
hold, the watchdog, NCCL's environment), with the `CudaApi` it runs on; only the `nccl` backend uses it. `NcclApi`: NCCL's C API itself (nccl.h), one method per C function, tensors for
buffers: the real one is `threadpar.comm.nccl.library.NcclLibrary`, the double's `FakeNccl`
(tests/fakes/fake_nccl.py); a contract suite (tests/test_nccl_contract.py) runs the same assertions on both. The real ones are `threadpar.comm.nccl.cuda_api.TorchCuda` and `LibraryNcclRuntime`;
tests pass `tests.fakes.fake_cuda_nccl.FakeCuda`, which models the GPUs and the library of one process
together and implements both, as `World(cuda=...)`. A test checks that the real ones and the double
implement every member here with the same parameters, so they cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

# Streams and events are torch.cuda.Stream / torch.cuda.Event on the real seam and the double's own classes
# in tests; the backends only call their record / wait_event / query / synchronize methods.
Stream = Any
Event = Any


@runtime_checkable
class CudaApi(Protocol):
    """CUDA primitives: streams, events, devices, copies."""

    def pool_stream(self, device: torch.device, priority: int) -> Stream:
        """torch.cuda.Stream(device, priority): one of torch's 32 pooled streams (the nccl backend takes them
        through NcclRuntime.streams)."""

    def current_stream(self, device: torch.device) -> Stream: ...

    def event(self) -> Event: ...

    def on_streams(self, *streams: Stream) -> contextlib.AbstractContextManager[None]: ...

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, src_stream: Stream, dst_stream: Stream) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None: ...

    def synchronize(self, device: torch.device) -> None: ...

    def graph(self) -> Any:
        """torch.cuda.CUDAGraph(): a graph to capture into and replay (its `replay()`)."""

    def capture(
        self, graph: Any, stream: Stream, generators: Sequence[torch.Generator]
    ) -> contextlib.AbstractContextManager[Any]:
        """torch.cuda.graph(graph, stream=stream), the generators registered for graph-safe replays."""


Communicator = Any  # threadpar.comm.nccl.library.Communicator, or the double's FakeComm


@runtime_checkable
class NcclApi(Protocol):
    """NCCL's C API (nccl.h). Buffers are contiguous tensors (count and ncclDataType_t come from them), ops
    are ncclRedOp_t values, streams the comm streams of CudaApi. Errors raise threadpar.errors.NcclError."""

    def version(self) -> tuple[int, int, int]:
        """ncclGetVersion, as (major, minor, patch)."""

    def error_string(self, code: int) -> str: ...

    def get_unique_id(self) -> bytes:
        """ncclGetUniqueId: the 128 bytes every rank of a new communicator passes to comm_init_rank."""

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, device: int) -> Communicator:
        """ncclCommInitRank on CUDA device `device`; blocks until all `nranks` ranks have joined."""

    def comm_init_rank_config(
        self, nranks: int, unique_id: bytes, rank: int, device: int, blocking: bool
    ) -> Communicator:
        """ncclCommInitRankConfig: a nonblocking one (`blocking=False`) returns at once and is ready once
        comm_get_async_error says 0; its calls may return while they go on (ncclInProgress: poll again)."""

    def comm_init_all(self, devices: Sequence[int]) -> list[Communicator]:
        """ncclCommInitAll: one communicator per listed device of this process, rank i on devices[i]."""

    def comm_destroy(self, comm: Communicator) -> None: ...

    def comm_abort(self, comm: Communicator) -> None:
        """ncclCommAbort: ends the communicator's queued and running operations and frees it."""

    def comm_get_async_error(self, comm: Communicator) -> int:
        """ncclCommGetAsyncError: the ncclResult_t of an asynchronous failure (0: none, 7: in progress)."""

    def red_op_create_pre_mul_sum(self, scalar: float, dtype: torch.dtype, comm: Communicator) -> int:
        """ncclRedOpCreatePreMulSum (NCCL 2.11+), the scalar held in `dtype` on the host: an ncclRedOp_t valid
        on `comm` and `dtype` only, each input times `scalar` before the sum."""

    def red_op_destroy(self, op: int, comm: Communicator) -> None:
        """ncclRedOpDestroy: frees an op of red_op_create_pre_mul_sum (the communicator must still be alive)."""

    def group_start(self) -> None: ...

    def group_end(self) -> int:
        """Launches every operation the calling thread issued since its outermost group_start; returns
        ncclSuccess (0), or ncclInProgress (7) if a nonblocking communicator's launch goes on."""

    def all_reduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: Communicator, stream: Stream
    ) -> None: ...

    def broadcast(
        self, send: torch.Tensor, recv: torch.Tensor, root: int, comm: Communicator, stream: Stream
    ) -> None: ...

    def reduce(
        self,
        send: torch.Tensor,
        recv: torch.Tensor | None,
        root: int,
        op: int,
        comm: Communicator,
        stream: Stream,
    ) -> None: ...

    def all_gather(
        self, send: torch.Tensor, recv: torch.Tensor, comm: Communicator, stream: Stream
    ) -> None: ...

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, comm: Communicator, stream: Stream
    ) -> None: ...

    def send(self, tensor: torch.Tensor, peer: int, comm: Communicator, stream: Stream) -> None: ...

    def recv(self, tensor: torch.Tensor, peer: int, comm: Communicator, stream: Stream) -> None: ...


@runtime_checkable
class NcclRuntime(Protocol):
    """The NCCL library and the process-wide NCCL state, over the CUDA primitives of `cuda`."""

    @property
    def cuda(self) -> CudaApi:
        """The CUDA primitives the communicators' streams and events come from."""

    @property
    def nccl(self) -> NcclApi:
        """NCCL's C API: the binding of the library torch loaded, or the double's FakeNccl."""

    @property
    def device_locks(self) -> Any:
        """One launch lock per device, held around every NCCL call on it (resources.DeviceLocks)."""

    @property
    def cliques(self) -> Any:
        """The process's pool of communicator cliques (threadpar.comm.nccl.resources.CliquePool)."""

    @property
    def streams(self) -> Any:
        """The comm streams live groups hold (threadpar.comm.nccl.resources.CommStreams)."""

    @property
    def watchdog(self) -> Any:
        """The process's NCCL watchdog (threadpar.comm.nccl.watchdog.Watchdog)."""

    def nccl_available(self) -> bool: ...

    def prepare_environment(self) -> None:
        """NCCL's environment variables, set before the process's first communicator."""
