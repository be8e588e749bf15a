"""ZeroRedundancyOptimizer.clip_grad_norm_: the whole model's gradient norm from the DP shards equals
torch.nn.utils.clip_grad_norm_ on one thread, and the clipped steps give the same parameters."""

import copy
import math

import pytest
import torch
from helpers.ddp_reference import assert_same, batches, mlp, mse, params_of, rank_slice
from helpers.gpt_reference import SMALL, dp_slice

import threadpar
from threadpar.models.gpt import GPT
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from threadpar.testing import run_ranks

HYPER = dict(lr=0.01, weight_decay=0.1)


def clipped_reference(model, data, loss, max_norm, norm_type):
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    norms = []
    for batch in data:
        optimizer.zero_grad()
        loss(model, *batch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
        optimizer.step()
    return torch.stack(norms)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_norm_over_the_shards_and_clipped_steps_match_one_thread(stage, world, norm_type):
    template = mlp()
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    max_norm = 0.05  # below every step's norm: every step clips
    reference = copy.deepcopy(template)
    expected_norms = clipped_reference(reference, data, mse, max_norm, norm_type)
    assert (expected_norms > max_norm).all()

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **HYPER)
        norms = []
        for x, y in data:
            zero.zero_grad()
            mse(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            norms.append(zero.clip_grad_norm_(max_norm, norm_type))
            zero.step()
        return torch.stack(norms), params_of(model)

    for norms, params in run_ranks(body, world):
        torch.testing.assert_close(norms, expected_norms.to(norms.dtype))
        assert_same(params, params_of(reference), "parameters after clipped steps")


def test_gpt_dp2_x_tp2_counts_tp_replicated_gradients_once():
    """LayerNorm weights are on both TP ranks: counted once; TP shards: summed; DP copies: sharded."""
    g = torch.Generator().manual_seed(0)
    model = GPT(SMALL).init_weights(g)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    shape = (8, SMALL.block_size)
    data = [
        (torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
        for _ in range(2)
    ]
    expected_norms = clipped_reference(model, data, lambda m, x, y: m.loss(x, y), 0.5, 2.0)
    expected = model.state_dict()

    def body():
        layout, coords = threadpar.get_layout(), threadpar.get_coords()
        hybrid = parallelize_gpt(SMALL, dense, num_microbatches=2)
        zero = ZeroRedundancyOptimizer(hybrid.parameters(), torch.optim.AdamW, stage=2, **HYPER)
        norms = []
        for x, y in data:
            hybrid.train_step(dp_slice(x, coords.dp, layout.dp), dp_slice(y, coords.dp, layout.dp))
            norms.append(zero.clip_grad_norm_(0.5))
            zero.step()
            zero.zero_grad()
        return torch.stack(norms), hybrid.dense_state()

    for norms, state in run_ranks(body, 4, tp=2):
        torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(
                value, expected[name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
