"""`CudaApi`: the CUDA and NCCL calls the backends make, as one seam that a test double can stand in for.

The real implementation is `threadpar.comm.nccl.cuda_api.TorchCuda` (torch.cuda streams and events,
torch.cuda.nccl); tests pass `tests.fakes.fake_cuda_nccl.FakeCuda` as `World(cuda=...)`. A test checks that
both implement every member here with the same parameters, so the two cannot drift apart.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch

# Streams and events are torch.cuda.Stream / torch.cuda.Event on the real seam and the double's own classes
# in tests; the backends only call their record / wait_event / query / synchronize methods.
Stream = Any
Event = Any


@runtime_checkable
class CudaApi(Protocol):
    @property
    def nccl(self) -> Any:
        """torch.cuda.nccl, or the double's FakeNccl: version, unique_id, init_rank and the collectives."""

    @property
    def launch_lock(self) -> contextlib.AbstractContextManager[Any]:
        """Held while a group enqueues NCCL calls on its devices, so calls of different groups never interleave."""

    @property
    def cliques(self) -> Any:
        """The process's pool of communicator cliques (threadpar.comm.nccl.resources.CliquePool)."""

    @property
    def inits(self) -> Any:
        """The devices whose communicators are being created (threadpar.comm.nccl.resources.DeviceInits)."""

    @property
    def streams(self) -> Any:
        """The comm streams live groups hold (threadpar.comm.nccl.resources.CommStreams)."""

    def nccl_available(self) -> bool: ...

    def pool_stream(self, device: torch.device, priority: int) -> Stream:
        """torch.cuda.Stream(device, priority): one of torch's 32 pooled streams (use through `streams`)."""

    def current_stream(self, device: torch.device) -> Stream: ...

    def event(self) -> Event: ...

    def on_streams(self, *streams: Stream) -> contextlib.AbstractContextManager[None]: ...

    def device_guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, src_stream: Stream, dst_stream: Stream) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None: ...

    def synchronize(self, device: torch.device) -> None: ...

    def async_error(self, comm: Any) -> str | None: ...
