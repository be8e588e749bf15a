"""Where a parameter's gradient lives when it is not in `param.grad`: no silent no-ops on the model's parameters.

Under ZeRO-2 (threadpar.parallel.ZeroRedundancyOptimizer(stage=2)) the reduced gradient is kept only as
this rank's shard, in the optimizer's own tensors, and `param.grad` is set to None. A function that reads
the gradients from `param.grad` (torch's clip_grad_norm_, a loss scaler's unscale, a manual all-reduce)
then finds none and silently does nothing: clip_grad_norm_ returned 0.0 and clipped nothing. The optimizer
marks each parameter whose gradient it holds (`mark_grad_holder`), and threadpar's functions that read
`param.grad` call `check_grads_in_params` first: a ConfigError names the parameter, who holds its gradient
and what to call instead. The mark is a weak reference to the holder (a ZeRO shard, kept by the optimizer
and by the DDP reducer that fills it): once neither is alive the parameter is an ordinary one again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from threadpar.errors import ConfigError

HOLDER_ATTR = "grad_holder"  # on a Parameter: its GradHolder


@dataclass(frozen=True)
class GradHolder:
    param: weakref.ref  # the marked parameter (a deepcopy of it carries the mark but is not it)
    holder: weakref.ref  # the object whose tensors hold this parameter's gradient
    description: str  # e.g. "ZeroRedundancyOptimizer(stage=2)"
    instead: str  # what to call instead, for each function that reads param.grad (a sentence)


def mark_grad_holder(param: torch.Tensor, holder: object, description: str, instead: str) -> None:
    """Record that `holder` keeps `param`'s gradient (and `param.grad` stays None)."""
    setattr(param, HOLDER_ATTR, GradHolder(weakref.ref(param), weakref.ref(holder), description, instead))


def check_grads_in_params(params: Iterable[torch.Tensor], what: str) -> None:
    """Raise a ConfigError if one of `params` has no `.grad` because another object holds its gradient:
    `what` (e.g. "threadpar.parallel.clip_grad_norm_") would silently skip it."""
    for index, param in enumerate(params):
        mark = getattr(param, HOLDER_ATTR, None)
        if not isinstance(mark, GradHolder) or param.grad is not None:
            continue
        if mark.param() is param and mark.holder() is not None:
            raise ConfigError(
                f"{what}: parameter #{index} (shape {list(param.shape)}) has no .grad because "
                f"{mark.description} keeps its reduced gradient (only this rank's shard of it), so {what} "
                f"would find no gradient and silently do nothing; {mark.instead}"
            )
