"""LossScaler: one rank's overflow skips the step and lowers the scale on every rank of a 3D layout; a
clean step steps everywhere and grows the scale; the split form (unscale, clip, step, update) agrees too."""

import math

import pytest
import torch

import threadpar
from threadpar.parallel import LossScaler, clip_grad_norm_, mark_grad_placements
from threadpar.testing import run_ranks


def one_step(scaler, param, bad_rank, bad_value):
    """A scaled gradient of 8 * scale on every entry; `bad_rank` puts `bad_value` in one entry."""
    param.grad = torch.full((3,), 8.0 * scaler.scale)
    if threadpar.get_rank() == bad_rank:
        param.grad[1] = bad_value
    optimizer = torch.optim.SGD([param], lr=0.125)
    return scaler.step(optimizer, [param])


@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan])
def test_one_ranks_overflow_skips_the_step_and_lowers_the_scale_on_every_rank(bad_value):
    def body():
        scaler = LossScaler(init_scale=4.0, growth_interval=1)  # group=None: the whole launch
        param = torch.nn.Parameter(torch.ones(3))
        skipped = one_step(scaler, param, bad_rank=5, bad_value=bad_value)
        after_skip = (skipped, scaler.scale, param.detach().clone(), param.grad, scaler.skipped_steps)
        stepped = one_step(scaler, param, bad_rank=-1, bad_value=0.0)  # nobody overflows
        return after_skip, (stepped, scaler.scale, param.detach().clone())

    for after_skip, after_step in run_ranks(body, 8, dp=2, tp=2, pp=2):
        stepped, scale, param, grad, skipped = after_skip
        assert not stepped and scale == 2.0 and skipped == 1
        assert torch.equal(param, torch.ones(3)) and grad is None  # nobody stepped; grads cleared
        stepped, scale, param = after_step
        assert stepped and scale == 4.0  # growth_interval=1: one good step doubles it back
        torch.testing.assert_close(param, torch.full((3,), 1.0 - 0.125 * 8.0))  # the unscaled gradient


def test_split_form_with_clipping_takes_the_same_branch_on_every_rank():
    """unscale_and_check -> clip_grad_norm_ -> step -> update: the clip (a collective) runs on all ranks
    or none, because the overflow flag is agreed; a rank without gradients takes part too."""

    def body(bad_rank):
        scaler = LossScaler(init_scale=2.0)
        param = torch.nn.Parameter(torch.zeros(4))
        mark_grad_placements(torch.nn.ParameterList([param]))
        if threadpar.get_coords().pp == 0:  # stage 1 has no gradients this step
            param.grad = torch.full((4,), 2.0 * 3.0)  # scaled by 2: the real gradient is 3s
            if threadpar.get_rank() == bad_rank:
                param.grad[0] = math.inf
        params = [param]
        overflow = scaler.unscale_and_check(params)
        norm = None
        if not overflow:
            norm = clip_grad_norm_(params, 1.0)
        scaler.update(overflow)
        return overflow, norm, scaler.scale, param.grad

    for overflow, norm, scale, grad in run_ranks(body, 4, -1, dp=2, pp=2):
        assert not overflow and scale == 2.0
        torch.testing.assert_close(norm, torch.tensor(6.0))  # 4 entries of 3 on stage 0, once over DP
        if grad is not None:
            torch.testing.assert_close(grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))
    for overflow, norm, scale, _ in run_ranks(body, 4, 1, dp=2, pp=2):  # rank 1: stage 0, dp 1
        assert overflow and norm is None and scale == 1.0


def test_bad_settings_are_refused():
    with pytest.raises(threadpar.ConfigError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value by the host (.item(), float(), bool(): aten._local_scalar_dense,
    the op that on CUDA waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bad_value", [None, math.inf])
def test_a_step_syncs_the_host_once(bad_value):
    def body():
        scaler = LossScaler(init_scale=4.0)
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]
        for p in params:
            p.grad = torch.full_like(p, 8.0)
        if bad_value is not None and threadpar.get_rank() == 1:
            params[1].grad[0] = bad_value
        with HostSyncs() as syncs:
            stepped = scaler.step(torch.optim.SGD(params, lr=0.125), params)
        return syncs.count, stepped

    assert run_ranks(body, 2) == [(1, bad_value is None)] * 2
