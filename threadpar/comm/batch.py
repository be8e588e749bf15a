"""`batch_isend_irecv` and `P2POp`: a list of sends and receives issued together, as torch.distributed has.

threadpar's sends are buffered (rule 8), so issuing the list in order can never deadlock, whatever order
the peers list their operations in; the Works complete as torch's do (a receive's tensor is valid once its
`wait()` returns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from threadpar.comm import torch_args
from threadpar.comm.common.work import Work
from threadpar.comm.functional import GroupLike, get_group, irecv, isend
from threadpar.errors import ConfigError


def _kind(op: object) -> str:
    """ "isend" or "irecv": threadpar's functions, or torch.distributed's (the same call here)."""
    import torch.distributed as dist

    if op is isend or op is getattr(dist, "isend", None):
        return "isend"
    if op is irecv or op is getattr(dist, "irecv", None):
        return "irecv"
    raise ConfigError(f"P2POp: op must be isend or irecv (threadpar's or torch.distributed's), got {op!r}")


class P2POp:
    """One send (`op=isend`) or receive (`op=irecv`) of `tensor` with `peer` (a global rank) or `group_peer`
    (a rank in `group`)."""

    def __init__(
        self,
        op: Callable,
        tensor: torch.Tensor,
        peer: int | None = None,
        group: GroupLike = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        self.kind = _kind(op)
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"P2POp: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.op, self.tensor, self.tag = op, tensor, tag
        self.group = get_group(group)
        self.peer = torch_args.required_peer("P2POp", self.group, "peer", peer, group_peer)
        self.group_peer = self.group.group_rank(self.peer)

    def __repr__(self) -> str:
        return (
            f"P2POp({self.kind} peer={self.peer} group='{self.group.name}', tag={self.tag}, "
            f"{self.tensor.dtype}{list(self.tensor.shape)})"
        )


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue every operation of the list (all on one group, as torch requires); returns their Works."""
    if (
        not isinstance(p2p_op_list, list)
        or not p2p_op_list
        or not all(isinstance(p, P2POp) for p in p2p_op_list)
    ):
        raise ConfigError("batch_isend_irecv: p2p_op_list must be a non-empty list of threadpar P2POp")
    group = p2p_op_list[0].group
    if any(p.group is not group for p in p2p_op_list):
        names = sorted({p.group.name for p in p2p_op_list})
        raise ConfigError(f"batch_isend_irecv: all ops must use the same group, got groups {names}")
    works = []
    for p in p2p_op_list:
        if p.kind == "isend":
            works.append(isend(p.tensor, p.peer, group, p.tag))
        else:
            works.append(irecv(p.tensor, p.peer, group, p.tag))
    return works
