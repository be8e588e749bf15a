"""Point-to-point messages on a group: buffered sends, receives into a tensor or as a new tensor."""

from __future__ import annotations

import torch

from threadpar.comm.common.work import CompletedWork, LazyText, LazyWork, Work
from threadpar.comm.handle import GroupHandle, spec
from threadpar.errors import ConfigError


class PointToPoint(GroupHandle):
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
        result = self._backend.send(self._member, dst_m, tag, tensor)
        if isinstance(result, Work):
            result.wait()  # stream-ordered: the caller's stream may reuse `tensor` once the copy has read it

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """On a stream-ordered backend, wait on the Work before overwriting `tensor`."""
        dst_m = self._p2p_check("isend", tensor, dst, "dst", tag)
        result = self._backend.send(self._member, dst_m, tag, tensor)
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
        got, message = self._backend.recv_message(self._member, src_m, tag, timeout)
        self._fill(tensor, message, got)
        return self.ranks[got]

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Returns a Work; `tensor` holds the message once `wait()` returns (or `is_completed()` says True)."""
        src_m = None if src is None else self._p2p_check("irecv", tensor, src, "src", tag)

        def complete(timeout: float | None) -> int:
            got, message = self._backend.recv_message(self._member, src_m, tag, timeout)
            self._fill(tensor, message, got)
            return self.ranks[got]

        return LazyWork(
            LazyText("irecv from rank {} (tag {}, group '{}')", src, tag, self.name),
            complete,
            lambda: self._backend.has_message(self._member, src_m, tag),
        )

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        """Receive a message as a new tensor: its shape and dtype travel with it (no preallocation)."""
        self._check_member("recv_tensor")
        src_m = self._to_member(src, "src")
        return self._backend.recv_message(self._member, src_m, tag, timeout)[1]

    def _fill(self, tensor: torch.Tensor, message: torch.Tensor, src_m: int) -> None:
        if tensor.shape != message.shape or tensor.dtype != message.dtype:
            raise ConfigError(
                f"recv on rank {self.global_rank}: the message from rank {self.ranks[src_m]} is "
                f"{spec(message)} but the receive tensor is {spec(tensor)}; "
                "allocate a matching tensor, or use recv_tensor() to receive any shape"
            )
        tensor.copy_(message)
