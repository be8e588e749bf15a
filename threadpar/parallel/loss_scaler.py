"""Dynamic loss scaling for fp16 training whose overflow check agrees across ranks.

Each rank holds different shards and stages of the model, so an inf may show up in one rank's gradients
only. The check is a MAX all-reduce of a 0/1 flag over the whole group (by default the launch's world):
one rank's overflow skips the step on every rank (and every rank lowers its scale), so replicas and shards
never diverge. For a user model:

    scaler = LossScaler()                                  # in every rank; group=None: the whole launch
    with torch.autocast(device.type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale_loss(loss).backward()
    scaler.step(optimizer, model.parameters())             # unscale, agree, step or skip, update the scale

To clip in between, split `step`: every rank takes the same branch, since the flag is agreed.

    overflow = scaler.unscale_and_check(params)
    if not overflow:
        clip_grad_norm_(params, 1.0)
        optimizer.step()
    scaler.update(overflow)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.functional import get_group
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.grad_holder import check_grads_in_params
from threadpar.runtime.context import get_device, in_rank


def _world_or(group: ProcessGroup | str | None) -> ProcessGroup:
    if isinstance(group, ProcessGroup):
        return group
    if group is None or isinstance(group, str):
        return get_group(group)
    raise TypeError(
        f"LossScaler: group must be None (the launch's world), a group name or a ProcessGroup, got {group!r}"
    )


class LossScaler:
    """fp16 loss scaling (torch.amp.GradScaler's growth/backoff rule) with an overflow flag agreed over
    `group`: scale starts at init_scale, is multiplied by backoff_factor on every overflow (the step is
    skipped) and by growth_factor after growth_interval steps in a row without one."""

    def __init__(
        self,
        group: ProcessGroup | str | None = None,
        *,
        init_scale: float = 2.0**14,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 200,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ConfigError(
                "LossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1"
            )
        self.group = _world_or(group)
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; True when any rank of the group saw an inf or nan. A
        collective over the group: every member calls it, also one without gradients."""
        params = list(params)
        check_grads_in_params(params, "LossScaler.unscale_and_check")
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else (get_device() if in_rank() else torch.device("cpu"))
        flag = torch.zeros(1, device=device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for where, group in by_device.items():
            # torch.amp.GradScaler's own kernel (grad_scaler.py, _unscale_grads_): unscales in place and sets
            # the flag on the device where any element is inf or nan, without a host sync.
            found = flag if where == flag.device else torch.zeros(1, device=where)
            inverse = torch.full((1,), 1.0 / self.scale, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inverse)
            if found is not flag:
                flag.copy_(torch.maximum(flag, found.to(flag.device)))
        self.group.all_reduce(flag, op=ReduceOp.MAX)
        return bool(flag.item())  # the step's one host sync: every rank must branch alike

    def update(self, overflow: bool) -> None:
        """After a step (or a skipped one): lower the scale on overflow, else count a good step and grow
        the scale after growth_interval of them."""
        if overflow:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, agree on overflow, step unless some rank overflowed; update the scale. True if stepped."""
        overflow = self.unscale_and_check(params)
        if overflow:
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
        self.update(overflow)
        return not overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
