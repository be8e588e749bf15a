"""No silent no-ops: under ZeRO-2 the reduced gradients live in the optimizer's shards and `param.grad` is
None, so functions that read `param.grad` would do nothing (clip_grad_norm_ returned 0.0 and clipped
nothing). They raise a ConfigError naming what to call; the stage-1 and plain paths are unchanged."""

import copy

import pytest
import torch
from helpers.ddp_reference import batches, mlp, mse, rank_slice

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import DistributedDataParallel, LossScaler, ZeroRedundancyOptimizer, clip_grad_norm_
from threadpar.parallel.groups import allreduce_grads
from threadpar.parallel.tensor_parallel import gather_dense_grads
from threadpar.testing import run_ranks

WORLD = 2


def _after_backward(stage: int):
    """On a rank: a DDP model with ZeroRedundancyOptimizer(stage) after one backward."""
    template = mlp()
    (x, y), *_ = batches(steps=1, rows=4, n_in=6, n_out=3)
    rank = threadpar.get_rank()
    model = copy.deepcopy(template)
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01)
    mse(ddp, rank_slice(x, rank, WORLD), rank_slice(y, rank, WORLD)).backward()
    return model, zero


CALLS = {
    "clip_grad_norm_": (
        lambda model, zero: clip_grad_norm_(model.parameters(), 1.0),
        "optimizer.clip_grad_norm_",
    ),
    "LossScaler": (lambda model, zero: LossScaler().step(zero, model.parameters()), "grad_holders()"),
    "allreduce_grads": (
        lambda model, zero: allreduce_grads(model.parameters(), threadpar.get_group()),
        "DistributedDataParallel",
    ),
    "gather_dense_grads": (lambda model, zero: gather_dense_grads(model), "optimizer.clip_grad_norm_"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_under_zero_2_reading_param_grad_raises_and_says_what_to_call(name):
    call, advice = CALLS[name]

    def body():
        model, zero = _after_backward(stage=2)
        assert all(p.grad is None for p in model.parameters())  # the premise: the shards hold them
        with pytest.raises(
            ConfigError, match=r"ZeroRedundancyOptimizer\(stage=2\) keeps its reduced gradient"
        ) as raised:
            call(model, zero)
        assert advice in str(raised.value)
        assert zero.clip_grad_norm_(1.0) > 0  # what to call instead works

    run_ranks(body, WORLD)


def test_under_zero_1_clip_grad_norm_still_clips_the_parameters():
    def body():
        model, _ = _after_backward(stage=1)
        before = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        norm = clip_grad_norm_(model.parameters(), 1e-3)
        after = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        torch.testing.assert_close(norm.double(), before, rtol=1e-5, atol=0)
        torch.testing.assert_close(after, torch.tensor(1e-3, dtype=after.dtype), rtol=1e-3, atol=0)

    run_ranks(body, WORLD)


def test_a_copy_of_a_zero_2_model_is_an_ordinary_model():
    def body():
        model, _ = _after_backward(stage=2)
        copied = copy.deepcopy(model)  # the parameters' marks are copied, but they name the originals
        assert clip_grad_norm_(copied.parameters(), 1.0) == 0  # no gradients, as torch's would say

    run_ranks(body, WORLD)
