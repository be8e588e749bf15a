"""ZeroRedundancyOptimizer on the GPT under dp x tp and dp x pp (parallelize_gpt), and with bf16
parameters and fp32 master weights: parameters after 3 AdamW steps equal one thread's."""

import copy
from dataclasses import replace

import pytest
import torch
from helpers.ddp_reference import batches, mlp, rank_slice
from helpers.gpt_reference import SMALL, dp_slice
from torch import nn

import threadpar
from threadpar.models.gpt import GPT
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from threadpar.testing import run_ranks

STEPS, LR = 3, 1e-2
CONFIG = replace(SMALL, n_layer=4)  # two blocks per stage at pp=2: enough, and half the time


def gpt_data(batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = GPT(CONFIG).init_weights(g)
    shape = (batch, CONFIG.block_size)
    data = [
        (
            torch.randint(0, CONFIG.vocab_size, shape, generator=g),
            torch.randint(0, CONFIG.vocab_size, shape, generator=g),
        )
        for _ in range(STEPS)
    ]
    return model, data


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["dp2xtp2", "dp2xpp2"])
def test_gpt_parameters_after_three_steps_match_one_thread(stage, layout):
    model, data = gpt_data()
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = adamw(model.parameters())
    for x, y in data:
        model.loss(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = model.state_dict()

    def body():
        layout_, coords = threadpar.get_layout(), threadpar.get_coords()
        hybrid = parallelize_gpt(CONFIG, dense, num_microbatches=2)
        zero = ZeroRedundancyOptimizer(
            hybrid.parameters(), torch.optim.AdamW, stage=stage, lr=LR, weight_decay=0.1
        )
        for x, y in data:
            hybrid.train_step(dp_slice(x, coords.dp, layout_.dp), dp_slice(y, coords.dp, layout_.dp))
            zero.step()
            zero.zero_grad()
        return hybrid.dense_state()

    covered = set()
    for state in run_ranks(body, 4, **layout):
        for name, value in state.items():
            # atol 1e-3: Adam divides by sqrt(v), so an element whose true gradient is about zero (the key
            # bias's is exactly zero) turns float noise from another summation order into updates; a wrong
            # shard or a missing all-gather is off by ~lr = 1e-2.
            torch.testing.assert_close(
                value, expected[name], rtol=1e-3, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}"
            )
            covered.add(name)
    assert covered == set(expected)


def master_weight_reference(template, data, world):
    """The recipe on one thread: bf16 parameters, an fp32 master copy that AdamW steps with the bf16
    gradient in fp32; each step's gradient is the average of the replicas' bf16 gradients (as DDP forms it),
    and the parameters get the master weights rounded to bf16."""
    model = copy.deepcopy(template)
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(master, lr=0.01, weight_decay=0.1)
    for x, y in data:
        grads = []
        for rank in range(world):
            model.zero_grad()
            loss = nn.functional.mse_loss(model(rank_slice(x, rank, world)), rank_slice(y, rank, world))
            loss.backward()
            grads.append([p.grad.float() for p in params])
        for m, *per_rank in zip(master, *grads):
            m.grad = (sum(per_rank) / world).to(torch.bfloat16).float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return {n: p.detach() for n, p in model.named_parameters()}, master


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_parameters_with_fp32_master_weights_match_the_recipe_on_one_thread(stage):
    world = 2
    template = mlp().to(torch.bfloat16)
    data = [
        (x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(steps=3, rows=8, n_in=6, n_out=3)
    ]
    expected, expected_master = master_weight_reference(template, data, world)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1
        )
        for x, y in data:
            nn.functional.mse_loss(ddp(rank_slice(x, rank, world)), rank_slice(y, rank, world)).backward()
            zero.step()
            zero.zero_grad()
        masters = zero.state_dict()["state"]
        return {n: p.detach() for n, p in model.named_parameters()}, masters

    for params, masters in run_ranks(body, world):
        for name, value in expected.items():
            assert params[name].dtype == torch.bfloat16
            torch.testing.assert_close(params[name], value, msg=lambda m, n=name: f"{n}: {m}")
        for i, master in enumerate(expected_master):
            saved = masters[i]["master_weight"]
            assert saved.dtype == torch.float32
            # fp32 master weights keep what bf16 rounds away: compare at fp32-ish precision (the averaging
            # of bf16 gradients may differ by one bf16 ulp between the backends' orders of operations).
            torch.testing.assert_close(saved, master, rtol=1e-3, atol=1e-4)
