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

The scale, the growth counter and the count of skipped steps live in tensors on the rank's device, as
torch.amp.GradScaler keeps them (torch/amp/grad_scaler.py), and change there (torch._amp_update_scale_):
`step` and `unscale_and_check` read the agreed flag on the host once, to branch. In a CUDA graph (or to
keep the host from waiting for the device), the device path skips the step without that read, through an
optimizer that takes the flag on the device (torch's fused Adam, AdamW, SGD: `fused=True`):

    found_inf = scaler.step_on_device(optimizer, params)   # a 0-dim tensor: 1.0 where the step was skipped

or, to clip in between (clipping inf gradients is harmless: the step that would use them is skipped):

    found_inf = scaler.unscale_on_device(params)
    clip_grad_norm_(params, 1.0)
    scaler.optimizer_step_on_device(optimizer, found_inf)
    scaler.update(found_inf)
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

_FLOAT32_MAX = torch.finfo(torch.float32).max


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
    skipped) and by growth_factor after growth_interval steps in a row without one.

    The state lives on the rank's device (the CPU outside a launch), made here so that a CUDA graph
    captured later finds it: `scale_tensor` (float32, 0-dim), the growth counter, `skipped_tensor`.
    `scale` and `skipped_steps` read them on the host (not in a graphed step)."""

    def __init__(
        self,
        group: ProcessGroup | str | None = None,
        *,
        init_scale: float = 2.0**14,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 200,
    ) -> None:
        if (
            not 0 < init_scale <= _FLOAT32_MAX
            or growth_factor <= 1
            or not 0 < backoff_factor < 1
            or growth_interval < 1
        ):
            raise ConfigError(
                "LossScaler: need 0 < init_scale <= float32's max (the scale is a float32 tensor), "
                "growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1"
            )
        self.group = _world_or(group)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        device = get_device() if in_rank() else torch.device("cpu")
        # GradScaler's state (grad_scaler.py, _lazy_init_scale_growth_tracker): a float32 scale and an int32
        # count of good steps since the last overflow or growth, both 0-dim, which _amp_update_scale_ takes.
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    # the state ---------------------------------------------------------------------------------------------------
    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale: a float32 0-dim tensor on the device, updated in place by every step."""
        return self._scale

    @property
    def skipped_tensor(self) -> torch.Tensor:
        """The number of skipped steps so far: an int64 0-dim tensor on the device, updated in place."""
        return self._skipped

    @property
    def scale(self) -> float:
        """The current scale as a number (a host read: it waits for the device)."""
        return float(self._scale)

    @property
    def skipped_steps(self) -> int:
        """The steps skipped on overflow so far (a host read)."""
        return int(self._skipped)

    def state_dict(self) -> dict:
        """Numbers (host reads; not in a graphed step). good_steps: the good steps since the last overflow or
        growth (GradScaler's _growth_tracker)."""
        return {
            "scale": self.scale,
            "good_steps": int(self._growth_tracker),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        scale = float(state["scale"])
        if not 0 < scale <= _FLOAT32_MAX:
            raise ConfigError(f"LossScaler.load_state_dict: scale {scale} is not a positive float32")
        self._scale.fill_(scale)
        # (a state written before the counter was reset at each growth: the same next growth, modulo)
        self._growth_tracker.fill_(int(state["good_steps"]) % self.growth_interval)
        self._skipped.fill_(int(state["skipped_steps"]))

    # scaling -----------------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss times the scale, read on the device (GradScaler.scale: a 0-dim fp16 loss comes out fp32)."""
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def unscale_on_device(self, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """Divide the gradients by the scale; the flag agreed over the group (MAX), a float32 0-dim tensor on
        the device, 1.0 when any rank saw an inf or nan. Reads nothing on the host. A collective over the
        group: every member calls it, also one without gradients."""
        return self._unscale_and_agree(params, "LossScaler.unscale_on_device")

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """unscale_on_device, read on the host: True when any rank of the group saw an inf or nan."""
        flag = self._unscale_and_agree(params, "LossScaler.unscale_and_check")
        return bool(flag.item())  # the step's one host sync: every rank must branch alike

    def _unscale_and_agree(self, params: Iterable[torch.nn.Parameter], what: str) -> torch.Tensor:
        params = list(params)
        check_grads_in_params(params, what)
        device = self._scale.device
        # 0-dim float32: what _amp_foreach_non_finite_check_and_unscale_ sets and what the fused optimizers
        # take as found_inf (torch/optim/adam.py, _fused_adam, subtracts it from the 0-dim step counts).
        flag = torch.zeros((), dtype=torch.float32, device=device)
        # In float64, as GradScaler.unscale_ takes it: "FP32 division can be imprecise".
        inverse = self._scale.double().reciprocal().float()
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                groups.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
        for (where, _), grads in groups.items():
            # GradScaler's own kernel (grad_scaler.py, _unscale_grads_, one call per device and dtype):
            # unscales in place and sets the flag on the device where any element is inf or nan.
            found = flag if where == device else torch.zeros((), dtype=torch.float32, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse.to(where))
            if found is not flag:
                flag.copy_(torch.maximum(flag, found.to(device)))
        self.group.all_reduce(flag, op=ReduceOp.MAX)
        return flag

    # stepping ----------------------------------------------------------------------------------------------------
    def update(self, overflow: bool | torch.Tensor) -> None:
        """After a step (or a skipped one): lower the scale on overflow, else count a good step and grow the
        scale after growth_interval of them. `overflow`: a bool, or the flag of unscale_on_device (read on the
        device only)."""
        device = self._scale.device
        if isinstance(overflow, torch.Tensor):
            found = overflow.to(device=device, dtype=torch.float32)
        else:
            found = torch.full((), float(bool(overflow)), dtype=torch.float32, device=device)
        # GradScaler.update's kernel (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp, cuda/AmpKernels.cu):
        # found: scale *= backoff, counter = 0; else counter + 1 == growth_interval: scale *= growth (kept
        # only if finite in float32), counter = 0; else counter += 1. That is the rule this class kept on the
        # host before (the scale grew whenever the good steps since the last overflow reached a multiple of
        # growth_interval): tests/test_loss_scaler_graphs.py compares them.
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        self._skipped.add_((found != 0).to(self._skipped.dtype))

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale, agree on overflow, step unless some rank overflowed; update the scale. True if stepped.
        One host read (the flag), to branch: not in a graphed step (there: step_on_device)."""
        flag = self._unscale_and_agree(params, "LossScaler.unscale_and_check")
        overflow = bool(flag.item())
        if overflow:
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
        self.update(flag)
        return not overflow

    def step_on_device(
        self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]
    ) -> torch.Tensor:
        """`step` without a host read, so a CUDA graph can hold it: unscale, agree, hand the flag to the
        optimizer, which skips its step on the device when it is set, update the scale on the device.
        Returns the agreed flag (1.0: the step was skipped on every rank). The optimizer must take the
        flag: torch's Adam, AdamW or SGD with fused=True (or a ZeroRedundancyOptimizer around one)."""
        _check_skips_on_device(optimizer, "LossScaler.step_on_device")
        flag = self._unscale_and_agree(params, "LossScaler.step_on_device")
        self.optimizer_step_on_device(optimizer, flag)
        self.update(flag)
        return flag

    def optimizer_step_on_device(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """optimizer.step(), skipped on the device where found_inf (unscale_on_device's flag) is set."""
        _check_skips_on_device(optimizer, "LossScaler.optimizer_step_on_device")
        # GradScaler.step's way for an optimizer with _step_supports_amp_scaling (grad_scaler.py): set
        # `found_inf` and `grad_scale` on it for the step, then delete them. grad_scale None: the gradients
        # are unscaled already (GradScaler's OptState.UNSCALED). The fused kernels leave parameters and
        # state alone where found_inf is set, and take it back from the step counts (_fused_adam).
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
            del optimizer.grad_scale  # type: ignore[attr-defined]


def _check_skips_on_device(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Refuse an optimizer that would ignore found_inf: skipping its step would need a branch on the host."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    name = type(optimizer).__name__
    inner = getattr(optimizer, "optimizer_class", None)  # (ZeroRedundancyOptimizer's wrapped class)
    fix = (
        f"pass fused=True to ZeroRedundancyOptimizer, which builds its {inner.__name__} with it"
        if isinstance(inner, type)
        else f"build it with fused=True (torch.optim.AdamW, Adam or SGD: {name}(..., fused=True))"
    )
    raise ConfigError(
        f"{what}: {name} cannot skip a step on the device (it does not read found_inf in step(); torch's fused "
        f"optimizers do, as torch.amp.GradScaler uses them): {fix}; or use LossScaler.step, which reads the "
        "overflow flag on the host (not in a CUDA graph)"
    )
