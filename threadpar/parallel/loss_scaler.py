"""Dynamic loss scaling for fp16 training whose overflow check agrees across ranks.

Each rank holds different shards and stages of the model, so an inf may show up in one rank's gradients
only. The check is a MAX all-reduce of a 0/1 flag over the whole group: one rank's overflow skips the
step on every rank (and every rank halves its scale), so replicas and shards never diverge.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.comm.reduce_op import ReduceOp
from threadpar.errors import ConfigError


class LossScaler:
    def __init__(
        self,
        group: ProcessGroup,
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
        self.group = group
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; True when any rank of the group saw an inf or nan."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        flag = torch.zeros(1, device=device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
            # One reduction per tensor, then one check: cheap, and a nan propagates through the sum.
            total = torch.stack([g.float().sum() for g in grads]).sum()
            flag.fill_(float(not torch.isfinite(total)))
        self.group.all_reduce(flag, op=ReduceOp.MAX)
        return bool(flag.item())

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, agree on overflow, step unless some rank overflowed; update the scale. True if stepped."""
        overflow = self.unscale_and_check(params)
        if overflow:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)
            return False
        optimizer.step()
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
