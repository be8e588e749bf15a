"""One rank's handle on a group: who it is in the group, how arguments are checked, how an op runs.

A group's shared state (its members, its backend object) exists once per launch; every member rank has
its own handle, which knows the member's index and counts its collectives. `ProcessGroup` (group.py) adds
the collectives and `PointToPoint` (point_to_point.py) the messages on top of this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.backend import Backend
from threadpar.comm.common.work import CompletedWork, LazyText, Work
from threadpar.comm.common.worker import CommWorker
from threadpar.errors import ConfigError

SUPPORTED_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
}  # fmt: skip


class GroupState:
    """What all members of a group share: its name, global ranks and backend object."""

    def __init__(
        self, name: str, ranks: Sequence[int], backend: Backend, timeout: float | None = None
    ) -> None:
        self.name = name
        self.ranks = tuple(ranks)
        self.member_of = {r: i for i, r in enumerate(self.ranks)}
        self.backend = backend
        self.timeout = timeout  # its own wait limit (seconds), or None: the launch's


def spec(t: torch.Tensor) -> str:
    """A short description of a tensor's dtype and shape, e.g. "float32[2, 3]"."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _contiguous(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object] | None]:
    """`tensor` itself, or a contiguous staging copy plus the function that writes it back."""
    if tensor.is_contiguous():
        return tensor, None
    staging = tensor.contiguous()
    return staging, lambda: tensor.copy_(staging)


def _write_back(result: Any, writebacks: Sequence[Callable[[], object] | None]) -> None:
    """Copy staging buffers back; after a stream-ordered backend's Work, once the caller's stream waits for it."""
    pending = [w for w in writebacks if w is not None]
    if pending:
        if isinstance(result, Work):
            result.wait()
        for writeback in pending:
            writeback()


def _below_autograd(fn: Callable[[], Any]) -> Any:
    """Run a collective with grad mode off, as c10d's C++ collectives write below autograd: an all-reduce of
    a leaf that requires grad (a parameter) is accepted by gloo and torch's threaded process group, and an
    in-place torch op on it under grad mode would raise. (Two C calls, not torch.no_grad(): this is on every
    collective's path, and grad mode is thread-local, so it is set on the thread that runs the op.)"""
    if not torch.is_grad_enabled():
        return fn()
    torch._C._set_grad_enabled(False)
    try:
        return fn()
    finally:
        torch._C._set_grad_enabled(True)


class GroupHandle:
    """One rank's seat in a group: identity, argument checks, sequence numbers, and how an op runs."""

    def __init__(self, state: GroupState, global_rank: int, worker: CommWorker | None, abort=None) -> None:
        self._state = state
        self._backend = state.backend
        self.name = state.name
        self.ranks: tuple[int, ...] = state.ranks
        self.global_rank = global_rank
        self._member = state.member_of.get(global_rank, -1)
        self._worker = worker
        self._abort = abort
        self._seq = 0
        # A stream-ordered backend (nccl) enqueues ops on its own streams and returns their Work itself.
        self._stream_ordered = state.backend.stream_ordered

    # identity ---------------------------------------------------------------------------------------------------
    def rank(self) -> int:
        """This rank's index in the group (-1 if it is not a member), like torch.distributed.get_rank(group)."""
        return self._member

    def size(self) -> int:
        return len(self.ranks)

    def is_member(self) -> bool:
        return self._member >= 0

    @property
    def stream_ordered(self) -> bool:
        """True when ops run on device streams (nccl): a synchronous one on the caller's current stream; an
        asynchronous one's Work finishes on the device, so `wait()` orders the caller's stream instead of
        blocking, and `get_future()` does not complete."""
        return self._stream_ordered

    def group_rank(self, global_rank: int) -> int:
        return self._to_member(global_rank, "rank")

    def __repr__(self) -> str:
        return f"ProcessGroup('{self.name}', ranks={list(self.ranks)}, rank={self._member})"

    # helpers ----------------------------------------------------------------------------------------------------
    def _to_member(self, global_rank: int, what: str) -> int:
        member = self._state.member_of.get(global_rank)
        if member is None:
            raise ConfigError(
                f"{what}={global_rank!r} is not a member of group '{self.name}' (global ranks {list(self.ranks)}); "
                f"{what} is a global rank, as in torch.distributed"
            )
        return member

    def _check_member(self, op: str) -> None:
        if self._member < 0:
            raise ConfigError(
                f"{op}: rank {self.global_rank} is not a member of group '{self.name}' "
                f"(global ranks {list(self.ranks)}); only members may call its collectives"
            )

    def _check_tensor(self, op: str, what: str, t: object) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"{op}: {what} has unsupported dtype {t.dtype}")
        return t

    def _check_list(
        self, op: str, what: str, tensors: object, like: torch.Tensor, same_shape: bool = True
    ) -> list:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != self.size():
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ConfigError(
                f"{op}: {what} must be a list of {self.size()} tensors (one per member), got {n}"
            )
        for i, t in enumerate(tensors):
            self._check_tensor(op, f"{what}[{i}]", t)
            if t.dtype != like.dtype or (same_shape and t.shape != like.shape):
                want = f"{spec(like)}" if same_shape else str(like.dtype)
                raise ConfigError(f"{op}: {what}[{i}] is {spec(t)} but must be {want}")
        return list(tensors)

    def _check_contiguous(self, op: str, what: str, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            raise ConfigError(
                f"{op}: {what} must be contiguous; pass {what}.contiguous() (and copy results back)"
            )

    def _next(self, op: str) -> int:
        self._check_member(op)
        self._seq += 1
        return self._seq

    def _run(self, op: str, seq: int, fn: Callable[[], Any], async_op: bool) -> Work | None:
        """Run now, or on the rank's comm worker. A synchronous op still queues behind pending async ops,
        so a rank's operations on a tensor happen in issue order, as on a CUDA stream. Either way below
        autograd (`_below_autograd`)."""
        fn = functools.partial(_below_autograd, fn)
        if self._stream_ordered:
            # Issued on device streams: an asynchronous op's Work orders the caller's stream when waited on;
            # a synchronous one ran on the caller's current stream, which orders what follows by itself.
            work = fn()
            return work if async_op else None
        worker = self._worker
        if not async_op:
            if worker is not None:
                # This rank would block until the op is done anyway: once the earlier async ops are
                # finished, run it here rather than hand it to the worker and back (one thread hop less).
                worker.wait_idle()
            fn()
            return None
        description = LazyText("{} #{} on group '{}' (rank {})", op, seq, self.name, self.global_rank)
        if worker is None:
            return CompletedWork(description, fn())
        return worker.submit(fn, Work(description, self._abort))
