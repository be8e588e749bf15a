"""Point-to-point messages on a group: buffered sends, receives into a tensor or as a new tensor.

Receives match a peer's messages in the order they were *posted*, as in torch.distributed (c10d and NCCL):
two irecvs from one peer with one tag get its first and second message, whichever is waited on first. A
receive takes its message from the mailbox when it completes, so before it does, the receives posted
earlier that could take the same message (same tag; the same source, or either from any source) complete.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from threadpar.comm.common.rendezvous import Call
from threadpar.comm.common.work import CompletedWork, LazyText, LazyWork, Work
from threadpar.comm.common.worker import CommWorker
from threadpar.comm.handle import GroupHandle, GroupState, _below_autograd, spec
from threadpar.errors import ConfigError


class PointToPoint(GroupHandle):
    def __init__(self, state: GroupState, global_rank: int, worker: CommWorker | None, abort=None) -> None:
        super().__init__(state, global_rank, worker, abort)
        # irecvs posted and maybe not complete, in posting order: (source member or None: any, tag, Work).
        # Posted on the rank thread, completed by whichever thread waits (a backward's engine thread too).
        self._receives: list[tuple[int | None, int, LazyWork]] = []
        self._receives_lock = threading.Lock()

    def _posted_before(self, src_m: int | None, tag: int) -> list[LazyWork]:
        """The pending receives, in posting order, that could take the message a receive from `src_m`
        with `tag` matches (forgetting the completed ones)."""
        with self._receives_lock:
            self._receives = [r for r in self._receives if not r[2]._done.is_set()]
            return [
                w for s, t, w in self._receives if t == tag and (s is None or src_m is None or s == src_m)
            ]

    def _p2p_check(self, op: str, tensor: torch.Tensor, peer: int, what: str, tag: int) -> int:
        self._check_member(op)
        self._check_tensor(op, "tensor", tensor)
        peer_m = self._to_member(peer, what)
        if peer_m == self._member:
            raise ConfigError(f"{op}: rank {self.global_rank} cannot {op} to or from itself ({what}={peer})")
        if not isinstance(tag, int):
            raise ConfigError(f"{op}: tag must be an int, got {tag!r}")
        return peer_m

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Buffered: returns as soon as the message is posted; `tensor` may be reused at once."""
        dst_m = self._p2p_check("send", tensor, dst, "dst", tag)
        self._backend.send(self._member, dst_m, tag, tensor, False)  # (a snapshot when stream-ordered)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """On a stream-ordered backend, wait on the Work before overwriting `tensor`."""
        dst_m = self._p2p_check("isend", tensor, dst, "dst", tag)
        result = self._backend.send(self._member, dst_m, tag, tensor, True)
        if isinstance(result, Work):
            return result
        return CompletedWork(LazyText("isend to rank {} (tag {}, group '{}')", dst, tag, self.name))

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, timeout: float | None = None
    ) -> int:
        """Receive into `tensor` (shape and dtype must match the message); returns the source's global rank."""
        src_m = None if src is None else self._p2p_check("recv", tensor, src, "src", tag)
        if src is None:
            self._check_member("recv")
        for earlier in self._posted_before(src_m, tag):
            earlier.wait_done(timeout)
        got, message = self._backend.recv_message(self._member, src_m, tag, timeout)
        self._fill(tensor, message, got)
        return self.ranks[got]

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Returns a Work; `tensor` holds the message once `wait()` returns (or `is_completed()` says True)."""
        src_m = None if src is None else self._p2p_check("irecv", tensor, src, "src", tag)
        if src is None:
            self._check_member("irecv")
        before = self._posted_before(src_m, tag)

        def complete(timeout: float | None) -> int:
            for earlier in before:
                earlier.wait_done(timeout)
            got, message = self._backend.recv_message(self._member, src_m, tag, timeout)
            self._fill(tensor, message, got)
            return self.ranks[got]

        def arrived() -> bool:
            return all(w.is_completed() for w in before) and self._backend.has_message(
                self._member, src_m, tag
            )

        work = LazyWork(
            LazyText("irecv from rank {} (tag {}, group '{}')", src, tag, self.name), complete, arrived
        )
        with self._receives_lock:
            self._receives.append((src_m, tag, work))
        return work

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        """Receive a message as a new tensor: its shape and dtype travel with it (no preallocation)."""
        self._check_member("recv_tensor")
        src_m = self._to_member(src, "src")
        for earlier in self._posted_before(src_m, tag):
            earlier.wait_done(timeout)
        return self._backend.recv_message(self._member, src_m, tag, timeout)[1]

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]] = (),
        recvs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Work:
        """Send each (dst, tensor) and receive into each (src, tensor), issued together; returns at once with
        a Work whose `wait()` makes the received tensors usable (on nccl: orders the caller's stream).

        The fast path of point to point, as torch's batch_isend_irecv on ProcessGroupNCCL: no tags, no
        buffering, no announcement, no copy, on the group's own communicator (nccl/exchange.py). What it asks:
        each pair's sends and receives match in the order both sides issue them, with the receive's shape; on
        nccl every rank issues its exchanges and the group's collectives in an order they all agree on (a
        pipeline schedule's), and the pairs were connected by a collective first (`permute` over them). A
        sent tensor must not change until the Work is done. `send`/`recv` keep torch.distributed's buffered,
        tagged semantics when that is not known."""
        name = "exchange"
        self._check_member(name)
        if not sends and not recvs:
            raise ConfigError(f"{name}: nothing to send or receive")
        out: list[tuple[int, torch.Tensor]] = []
        into: list[tuple[int, torch.Tensor]] = []
        for what, ops, target in (("sends", sends, out), ("recvs", recvs, into)):
            for i, op in enumerate(ops):
                if not (isinstance(op, tuple) and len(op) == 2):
                    raise ConfigError(f"{name}: {what}[{i}] must be a (rank, tensor) pair, got {op!r}")
                peer, tensor = op
                self._check_tensor(name, f"{what}[{i}]", tensor)
                peer_m = self._to_member(peer, f"{what}[{i}]'s rank")
                if peer_m == self._member:
                    raise ConfigError(
                        f"{name}: rank {self.global_rank} cannot exchange with itself ({what}[{i}])"
                    )
                if what == "recvs":
                    self._check_contiguous(name, f"{what}[{i}]", tensor)
                target.append((peer_m, tensor if tensor.is_contiguous() else tensor.contiguous()))
        result = _below_autograd(lambda: self._backend.exchange(self._member, out, into))
        if isinstance(result, Work):
            return result
        return CompletedWork(LazyText("exchange on group '{}' (rank {})", self.name, self.global_rank))

    def connect(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Make point to point ready for each (sender, receiver) of global ranks in `pairs`, so that `exchange`
        over them later waits for no peer on the host. A collective: every member calls it, with the same
        pairs. On nccl, NCCL connects a pair at its first use, inside the call, until the peer does the same
        (src/group.cc, ncclP2PPreconnectFunc); here that first use is one byte across each pair after a
        meeting of the members. Nothing to do on the other backends (their messages are buffered)."""
        name = "connect"
        members = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ConfigError(
                    f"{name}: pairs must be (sender, receiver) tuples of global ranks, got {pair!r}"
                )
            a, b = (self._to_member(r, "a pair's rank") for r in pair)
            if a == b:
                raise ConfigError(f"{name}: a rank cannot connect to itself ({pair!r})")
            members.append((a, b))
        seq = self._next(name)
        connected = frozenset(members)
        call = Call(name, extra=(("pairs", tuple(sorted(connected))),))
        member, backend = self._member, self._backend
        self._run(name, seq, lambda: backend.connect(member, seq, call, connected), False)

    def _fill(self, tensor: torch.Tensor, message: torch.Tensor, src_m: int) -> None:
        if tensor.shape != message.shape or tensor.dtype != message.dtype:
            raise ConfigError(
                f"recv on rank {self.global_rank}: the message from rank {self.ranks[src_m]} is "
                f"{spec(message)} but the receive tensor is {spec(tensor)}; "
                "allocate a matching tensor, or use recv_tensor() to receive any shape"
            )
        tensor.copy_(message)
