"""The GPU tier for what issue 15/16 built on the nccl path (issue 22): ZeRO-1/2 (with fp32 master weights),
LossScaler, the zero-bubble schedule with prefetch, and autocast, on every visible GPU with the nccl backend,
against the single-thread model (fp32/fp64) or the threads backend on CPU running the same recipe (low
precision, at a tolerance that allows cuBLAS's other rounding). Skipped without GPUs (tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.ddp_reference import assert_same, batches, mlp, mse, params_of, rank_slice
from helpers.gpus import GPU_TIMEOUT_S, gpus_or_skip, run_gpus
from helpers.zero_reference import reference
from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks
from test_pipeline_executor import reference as pipeline_reference

import threadpar
from threadpar.parallel import DistributedDataParallel, LossScaler, ZeroRedundancyOptimizer
from threadpar.pipeline import PipelineParallel
from threadpar.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
TEMPLATE = mlp()  # float64: exact parity up to summation order
LOW = dict(rtol=3e-2, atol=3e-3)  # bf16/fp16 on another device's kernels


def zero_steps(stage: int, n: int, dtype: torch.dtype = torch.float64, scaled: bool = False) -> dict:
    """DDP + ZeRO(AdamW) for 3 steps on this rank's rows; bf16/fp16 parameters get fp32 master weights, and
    `scaled` puts a LossScaler over the optimizer's gradient holders."""
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device, dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0, first_bucket_cap_mb=0.0)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1
    )
    scaler = LossScaler(init_scale=2.0**8) if scaled else None
    for x, y in batches(steps=3, rows=4 * n, n_in=6, n_out=3):
        optimizer.zero_grad()
        x, y = (rank_slice(t, rank, n).to(device, dtype) for t in (x, y))
        loss = mse(ddp, x, y).float()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale_loss(loss).backward()
            assert scaler.step(optimizer, optimizer.grad_holders())
    return {k: v.cpu() for k, v in params_of(model).items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_every_gpu_matches_one_thread(stage):
    n = gpus_or_skip(2)
    data = batches(steps=3, rows=4 * n, n_in=6, n_out=3)
    expected, _, _ = reference(TEMPLATE, data, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))
    for params in run_gpus(zero_steps, n, stage, n):
        assert_same(params, expected, f"parameters (stage {stage})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_zero2_master_weights_with_loss_scaler_match_the_threads_backend(dtype):
    n = gpus_or_skip(2)
    want = run_ranks(zero_steps, n, 2, n, dtype, True, timeout=GPU_TIMEOUT_S)
    for got, expected in zip(run_gpus(zero_steps, n, 2, n, dtype, True), want):
        for name in expected:
            torch.testing.assert_close(got[name].float(), expected[name].float(), **LOW, msg=name)


def zbh1_step() -> dict:
    device = threadpar.get_device()
    inputs, targets = make_batch(8)
    model = make_model(5).to(device)
    chunks = my_chunks(model, 1)
    pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule="zbh1", num_microbatches=4, prefetch=True)
    loss = pipe.train_step(inputs.to(device), targets.to(device))
    mine = {id(p) for c in chunks for p in c.parameters()}
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if id(p) in mine}
    return {"loss": loss.cpu(), "grads": grads}


def test_zero_bubble_with_prefetch_over_two_stages_matches_one_thread():
    gpus_or_skip(2)
    inputs, targets = make_batch(8)
    ref_loss, ref_model = pipeline_reference(5, inputs, targets)
    results = run_gpus(zbh1_step, 2, pp=2)
    # cuBLAS sums in another order than the CPU reference: fp32 parity at a slightly wider tolerance.
    seen = {}
    for result in results:
        torch.testing.assert_close(result["loss"], ref_loss, rtol=1e-4, atol=1e-5)
        seen.update(result["grads"])
    assert seen.keys() == {name for name, _ in ref_model.named_parameters()}
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-3, atol=1e-5, msg=name)


def autocast_step(n: int) -> dict:
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).float().to(device)
    ddp = DistributedDataParallel(model)
    x, y = (t.float() for t in batches(steps=1, rows=4 * n, n_in=6, n_out=3)[0])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = mse(ddp, rank_slice(x, rank, n).to(device), rank_slice(y, rank, n).to(device))
    loss.float().backward()
    return {name: p.grad.cpu() for name, p in model.named_parameters()}


def test_ddp_under_bf16_autocast_matches_the_threads_backend():
    n = gpus_or_skip(2)
    want = run_ranks(autocast_step, n, n, timeout=GPU_TIMEOUT_S)
    for got, expected in zip(run_gpus(autocast_step, n, n), want):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **LOW, msg=name)
