"""Where a parameter's gradient lives when it is not in `param.grad`: no silent no-ops on the model's parameters.

Under ZeRO-2 (threadpar.parallel.ZeroRedundancyOptimizer(stage=2)) the reduced gradient is kept only as
this rank's shard, in the optimizer's own tensors, and `param.grad` is set to None. A function that reads
the gradients from `param.grad` (torch's clip_grad_norm_, a loss scaler's unscale, a manual all-reduce)
then finds none and silently does nothing: clip_grad_norm_ returned 0.0 and clipped nothing. The optimizer
records itself as the holder of each such parameter's gradient in the rank's table (`mark_grad_holder`, a
`GradHolder` record: threadpar.parallel.records), and threadpar's functions that read `param.grad` call
`check_grads_in_params` first: a ConfigError names the parameter, who holds its gradient and what to call
instead. The record holds the holder (a ZeRO shard, kept by the optimizer and by the DDP reducer that
fills it) weakly: once neither is alive the parameter is an ordinary one again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from threadpar.errors import ConfigError
from threadpar.parallel.records import GradHolder, param_table, records_of


def mark_grad_holder(param: torch.Tensor, holder: object, description: str, instead: str) -> None:
    """Record that `holder` keeps `param`'s gradient (and `param.grad` stays None). On a rank thread."""
    param_table().add_parameter(param, GradHolder(weakref.ref(holder), description, instead))


def check_grads_in_params(params: Iterable[torch.Tensor], what: str) -> None:
    """Raise a ConfigError if one of `params` has no `.grad` because another object holds its gradient:
    `what` (e.g. "threadpar.parallel.clip_grad_norm_") would silently skip it."""
    params = list(params)
    if all(param.grad is not None for param in params):
        return  # the common case: no table lookup
    for index, (param, records) in enumerate(zip(params, records_of(params))):
        if param.grad is not None:
            continue
        for mark in records:
            if isinstance(mark, GradHolder) and mark.holder() is not None:
                raise ConfigError(
                    f"{what}: parameter #{index} (shape {list(param.shape)}) has no .grad because "
                    f"{mark.description} keeps its reduced gradient (only this rank's shard of it), so {what} "
                    f"would find no gradient and silently do nothing; {mark.instead}"
                )
