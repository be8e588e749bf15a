"""What the parallel wrappers share about groups: resolving a `group=` argument, summing gradients over one.

`group=None` means this rank's group on the wrapper's own axis (TP for the tensor-parallel layers, CP for
ring attention, DP for the experts of a MoE layer). Resolve it when a layer or autograd Function is
built, on the rank thread, never inside backward (DESIGN.md rule 2).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from threadpar.comm.functional import get_group
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.grad_holder import check_grads_in_params


def resolve_group(group: ProcessGroup | str | None, axis: str) -> ProcessGroup:
    """`group` as a handle: None means this rank's group on `axis`; an axis or group name is looked up."""
    if isinstance(group, ProcessGroup):
        handle = group
    elif group is None or isinstance(group, str):
        handle = get_group(axis if group is None else group)
    else:
        raise TypeError(
            f"group must be None (this rank's {axis} group), an axis or group name, or a ProcessGroup; "
            f"got {group!r}"
        )
    if not handle.is_member():
        raise ConfigError(
            f"rank {handle.global_rank} is not a member of group '{handle.name}' {list(handle.ranks)}; "
            f"pass a group this rank belongs to (None means its own {axis} group)"
        )
    return handle


def allreduce_grads(params: Iterable[torch.nn.Parameter], group: ProcessGroup) -> None:
    """Sum the gradients of `params` over `group`: one coalesced all-reduce per dtype, in the same order on
    every member. Parameters without a gradient are skipped (every member must skip the same ones)."""
    params = list(params)
    check_grads_in_params(params, "allreduce_grads")
    if group.size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for dtype in sorted(by_dtype, key=str):
        group.all_reduce_coalesced(by_dtype[dtype])
