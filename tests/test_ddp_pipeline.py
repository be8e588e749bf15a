"""DistributedDataParallel around pipeline chunks on a DP x PP layout: the executor runs every backward but
the last of a step inside no_sync(), and the result must match one thread on the whole batch."""

import copy

import pytest
import torch
from helpers.ddp_reference import DTYPE, batches, mse, rank_slice
from torch import nn

import threadpar
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.ddp import comm_hooks
from threadpar.pipeline import PipelineParallel, build_chunks
from threadpar.testing import run_ranks


def deep_mlp(layers: int = 5) -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(layers)]
    model = nn.Sequential(*blocks, nn.Linear(6, 3)).to(DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.5)
    return model


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2), ("afab", 1)])
def test_ddp_chunks_in_a_dp_x_pp_pipeline_match_one_thread(schedule, v):
    dp, pp, micro = 2, 2, 4
    template = deep_mlp()
    x, y = batches(steps=1, rows=dp * micro * 2, n_in=6, n_out=3)[0]
    reference = copy.deepcopy(template)
    mse(reference, x, y).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    launches = []

    def counting_hook(group, bucket):
        launches.append(bucket.index())
        return comm_hooks.allreduce_hook(group, bucket)

    def body():
        c = threadpar.get_coords()
        model = copy.deepcopy(template)
        layers = list(model)
        chunks = build_chunks(layers[:-1], pp_size=pp, pp_rank=c.pp, chunks_per_stage=v, last=layers[-1])
        wrapped = [DistributedDataParallel(chunk, bucket_cap_mb=0, first_bucket_cap_mb=0) for chunk in chunks]
        if threadpar.get_rank() == 0:
            wrapped[0].register_comm_hook(None, counting_hook)
        pipe = PipelineParallel(
            wrapped, loss_fn=nn.functional.mse_loss, schedule=schedule, num_microbatches=micro
        )
        pipe.train_step(rank_slice(x, c.dp, dp), rank_slice(y, c.dp, dp))
        mine = {id(p) for chunk in chunks for p in chunk.parameters()}
        return {name: p.grad for name, p in model.named_parameters() if id(p) in mine}, len(
            wrapped[0].reducer.bucket_indices()
        )

    results = run_ranks(body, dp * pp, pp=pp)
    seen = {}
    for grads, _ in results:
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")
            seen[name] = True
    assert seen.keys() == expected.keys()
    assert launches == list(range(results[0][1]))  # rank 0's first chunk synchronized once, every bucket
