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
    one use both). Ranks given here (src, dst) are member indices. A stream-ordered backend issues the op on
    device streams: synchronous (`async_op=False`) on the caller's current stream, returning None (the stream
    orders what follows; a barrier waits on the host, a send snapshots its tensor), asynchronous on a comm
    stream, returning its Work. The others complete the op (on the member's comm worker for an asynchronous
    one: ProcessGroup decides) and return None, whatever `async_op` says. ProcessGroup (group.py,
    point_to_point.py) checks the arguments before it calls any of these.
    """

    stream_ordered: bool  # a class attribute: True when ops run on device streams (their own Works, if async)
    backend_name: str  # a class attribute: what threadpar.get_backend(group) says ("threads", "nccl", ...)

    def all_reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> Work | None: ...

    def reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp,
        async_op: bool = False,
    ) -> Work | None: ...

    def broadcast(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int, async_op: bool = False
    ) -> Work | None: ...

    def all_gather(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
    ) -> Work | None: ...

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> Work | None: ...

    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
        async_op: bool = False,
    ) -> Work | None: ...

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
        async_op: bool = False,
    ) -> Work | None: ...

    def all_to_all(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        async_op: bool = False,
    ) -> Work | None: ...

    def permute(
        self,
        member: int,
        seq: int,
        call: Call,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        src_dst: list[int],
        async_op: bool = False,
    ) -> Work | None:
        """Member m sends `inputs` to member src_dst[m]; `outputs` receives from the member that sends to m."""
        ...

    def connect(self, member: int, seq: int, call: Call, pairs: frozenset[tuple[int, int]]) -> None:
        """Make point to point from a to b ready for every (a, b) in `pairs` (members), so that `exchange`
        over them waits for no peer (nccl; nothing to do where messages are buffered)."""
        ...

    def barrier(
        self, member: int, seq: int, call: Call, timeout: float | None = None, async_op: bool = False
    ) -> Work | None:
        """`timeout`: how long a member waits for the others (seconds; None: the group's)."""
        ...

    def send(
        self, member: int, dst: int, tag: int, tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None: ...

    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]: ...

    def exchange(
        self, member: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> Work | None:
        """Sends of each (dst, tensor) and receives into each (src, tensor), issued together; matched per pair
        in issue order without tags (ProcessGroup.exchange). A stream-ordered backend returns the Work."""
        ...

    def has_message(self, member: int, src: int | None, tag: int) -> bool: ...

    def close(self, failed: bool) -> None:
        """The launch has ended (every rank thread finished): let go of what the group holds (`failed`: the
        launch failed or was stopped)."""


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

    def fail(self, rank: int, error: BaseException) -> None:
        """Report `error` as global rank `rank`'s failure from a thread other than the rank's (the nccl
        watchdog): the launch stops and reports it as that rank's, as if the rank had raised it."""

    def cuda_api(self) -> CudaApi:
        """The CUDA primitives (what the threads backend orders its work on CUDA tensors with)."""

    def nccl_runtime(self) -> NcclRuntime:
        """The NCCL library and process state (only the nccl backend asks for it)."""

    def release_graphs(self, wait: bool) -> None:
        """Reset every CUDA graph the launch's ranks captured (after their replays finished, if `wait`): called
        before a communicator is destroyed or aborted, which NCCL >= 2.26 makes wait until every graph that
        captured it is gone (src/init.cc, commDestroySync)."""
