"""The seams of a backend: the operations every backend implements, and what it takes from the launch's World."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import CudaApi, NcclRuntime
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.rendezvous import Call
from threadpar.comm.common.work import Work


@runtime_checkable
class Backend(Protocol):
    """One group's shared state on a backend (ThreadsGroup, NcclGroup, HierarchicalGroup, NcclSpanningGroup).

    Every member thread calls the operations with its index `member` in the group; `seq` counts that member's
    collectives on the group and `call` describes the collective (the checks that all members called the same
    one use both). Ranks given here (src, dst) are member indices. A stream-ordered backend enqueues the op on
    its own streams and returns its Work; the others complete the op (on the member's comm worker) and return
    None. ProcessGroup (group.py, point_to_point.py) checks the arguments before it calls any of these.
    """

    stream_ordered: bool  # a class attribute: True when ops return their own Work (ordered on device streams)
    backend_name: str  # a class attribute: what threadpar.get_backend(group) says ("threads", "nccl", ...)

    def all_reduce(
        self, member: int, seq: int, call: Call, tensors: list[torch.Tensor], op: ReduceOp
    ) -> Work | None: ...

    def reduce(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, dst: int, op: ReduceOp
    ) -> Work | None: ...

    def broadcast(self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int) -> Work | None: ...

    def all_gather(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], tensor: torch.Tensor
    ) -> Work | None: ...

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
    ) -> Work | None: ...

    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
    ) -> Work | None: ...

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
    ) -> Work | None: ...

    def all_to_all(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> Work | None: ...

    def barrier(self, member: int, seq: int, call: Call, timeout: float | None = None) -> Work | None:
        """`timeout`: how long a member waits for the others (seconds; None: the group's)."""
        ...

    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor) -> Work | None: ...

    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]: ...

    def has_message(self, member: int, src: int | None, tag: int) -> bool: ...


class BackendSite(Protocol):
    """What select_backend and the backends take from the launch (threadpar.runtime.world.World)."""

    backend: str  # "threads" or "nccl"
    devices: tuple[torch.device, ...]  # one per global rank
    cuda: CudaApi | None  # a test double (of CudaApi and NcclRuntime), or None for torch.cuda
    processes: Any  # threadpar.runtime.peer_processes.Processes, or None in a one-process launch
    abort: AbortSignal
    timeout: float
    check_collectives: bool

    @property
    def local_ranks(self) -> range: ...

    def cuda_api(self) -> CudaApi:
        """The CUDA primitives (what the threads backend orders its work on CUDA tensors with)."""

    def nccl_runtime(self) -> NcclRuntime:
        """The NCCL library and process state (only the nccl backend asks for it)."""
