"""Global gradient clipping: torch's `clip_grad_norm_` over a model split across the ranks of a launch.

    loss.backward()                          # DDP has reduced the gradients; SP-replicated ones are summed
    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)   # every rank of the launch calls it
    optimizer.step()

The norm is that of the whole model's gradient, as `torch.nn.utils.clip_grad_norm_` computes it on the
dense model: each rank adds |g|^p of the pieces it counts (TP and EP shards and pipeline stages are
distinct; of identical copies only the first member's counts, see placement.py), one all-reduce over
the launch sums them (a MAX for the inf norm), and every rank gets the same total and the same clip
coefficient. `total_grad_norm` (gradient tensors with their placements) and `scale_grads_by_norm_` are
the two halves, for optimizers whose gradients are not `param.grad` (ZeRO's shards).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from threadpar.comm.common.gpu import is_gpu
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.functional import get_group
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.clip_grad.placement import grad_placements
from threadpar.parallel.grad_holder import check_grads_in_params
from threadpar.parallel.records import GradPlacement
from threadpar.runtime.context import get_device, in_rank


def check_norm_type(norm_type: float | str) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:  # also rejects nan
        raise ConfigError(
            f"norm_type={norm_type!r}: a gradient norm is a p-norm with p > 0 (2.0, 1.0, ...) or "
            "float('inf') for the largest absolute entry"
        )
    return value


def _check_max_norm(max_norm: float) -> float:
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0:
        raise ConfigError(f"max_norm={max_norm!r}: pass the largest allowed norm, a number >= 0")
    return value


def _reduction(group: ProcessGroup | None) -> tuple[ProcessGroup | None, torch.device]:
    """The group that sums the pieces (the launch's world) and the device its buffer lives on."""
    if not in_rank():
        return group, torch.device("cpu")  # one thread: the norm of these tensors, as torch computes it
    return (get_group() if group is None else group), get_device()


@torch.no_grad()
def total_grad_norm(
    grads: Sequence[torch.Tensor],
    placements: Sequence[GradPlacement],
    norm_type: float | str = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """The p-norm of the whole model's gradient from every rank's pieces: a collective over `group`
    (None: the launch's world), so every member calls it, also with no tensors. Returns a float32 0-dim
    tensor on this rank's device, equal on every member. A non-finite norm with error_if_nonfinite raises
    RuntimeError on every member alike (each sees the same reduced value)."""
    p = check_norm_type(norm_type)
    if len(grads) != len(placements):
        raise ConfigError(f"total_grad_norm: {len(grads)} gradients but {len(placements)} placements")
    group, device = _reduction(group)
    counted = [g for g, where in zip(grads, placements) if where.counted]
    local = torch.zeros((), dtype=torch.float32, device=device)
    if counted:
        local = torch.nn.utils.get_total_norm(counted, p, False, foreach).to(device, torch.float32)
    if math.isinf(p):
        # A MAX need not propagate nan (NCCL's does not), so a nan travels as a flag: [max |g|, any nan].
        is_nan = local.isnan()
        parts = torch.stack([torch.where(is_nan, math.inf, local), is_nan.float()])
        if group is not None and group.size() > 1:
            group.all_reduce(parts, op=ReduceOp.MAX)
        total = torch.where(parts[1] > 0, math.nan, parts[0])
    else:
        parts = local.pow(p).reshape(1)  # sum |g|^p of this rank's counted pieces; a nan survives a sum
        if group is not None and group.size() > 1:
            group.all_reduce(parts, op=ReduceOp.SUM)
        total = parts[0].pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite ({total.item()}) on "
            "every rank, so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


@torch.no_grad()
def scale_grads_by_norm_(
    grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None
) -> None:
    """Multiply `grads` in place by min(max_norm / (total_norm + 1e-6), 1), as torch's
    clip_grads_with_norm_ does (torch/nn/utils/clip_grad.py: always multiplied, no host sync)."""
    max_norm = _check_max_norm(max_norm)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), same in by_kind.items():
        factor = coef.to(device)
        if foreach or (foreach is None and (device.type == "cpu" or is_gpu(device))):
            torch._foreach_mul_(same, factor)
        else:
            for grad in same:
                grad.mul_(factor)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model split over the launch: the norm of the whole model's
    gradient (every rank's parameters together, each copy counted once), clipped in place on every rank.

    A collective over the launch's world: every rank calls it (a rank with no gradients too; DESIGN.md
    rule 6), after gradients are reduced. Arguments are checked before the collective (DESIGN.md rule 11). Each parameter must carry its placement (DistributedDataParallel and
    mark_grad_placements set it); with only pipeline stages (dp = cp = tp = 1) unmarked ones are fine.
    Returns the total norm (float32, the same on every rank)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _check_max_norm(max_norm)
    check_norm_type(norm_type)
    check_grads_in_params(params, "threadpar.parallel.clip_grad_norm_")  # ZeRO-2 holds them elsewhere
    with_grad = [p for p in params if p.grad is not None]
    placements = grad_placements(with_grad)
    grads = [p.grad for p in with_grad if p.grad is not None]  # all of them (for the type checker)
    total = total_grad_norm(
        grads, placements, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
    )
    scale_grads_by_norm_(grads, max_norm, total, foreach)
    return total
