"""What was built on the nccl path, on the CUDA/NCCL double (issue 22): ZeRO-1/2 (with fp32 master weights),
LossScaler, a zero-bubble pipeline with prefetch, autocast. Each runs with the double computing collectives
at launch and lazily (conftest.fake_mode: a buffer touched before its collective ran is reported as a race),
and where a backward reduces gradients, also with backward on a device thread without the rank's context
(as CUDA's autograd runs it: fakes/fake_autograd_thread.py). Results are checked against one thread (fp32/
fp64) or against the threads backend running the same recipe (low precision: the same algorithm)."""

import copy

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host
from helpers.ddp_reference import assert_same, batches, mlp, mse, params_of, rank_slice
from helpers.zero_reference import assert_same_state, plain, reference, zero, zero_run
from test_pipeline_executor import (
    assert_matches_reference,
    lm_loss,
    make_batch,
    make_model,
    my_chunks,
    my_gradients,
)
from test_pipeline_executor import reference as pipeline_reference

import threadpar
from threadpar.parallel import DistributedDataParallel, LossScaler, ZeroRedundancyOptimizer
from threadpar.pipeline import PipelineParallel
from threadpar.testing import run_ranks

# Each test runs with the double running NCCL operations once issued and lazily (conftest.fake_mode).
pytestmark = pytest.mark.usefixtures("fake_mode")

TEMPLATE = mlp()  # made here, in the test's thread (mlp() seeds the global generator)
THREAD = [False, True]
THREAD_IDS = ["rank-thread", "device-thread"]


def on_double(autograd_thread: bool = False, **layout):
    return lambda body, world: run_fake_gpus(body, world, FakeCuda(autograd_thread=autograd_thread), **layout)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("autograd_thread", THREAD, ids=THREAD_IDS)
def test_zero_on_the_double_matches_one_thread(stage, autograd_thread):
    template = TEMPLATE
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    expected, expected_state, _ = reference(template, data, plain(torch.optim.AdamW))
    runner = on_double(autograd_thread)
    caps = dict(bucket_cap_mb=0.0, first_bucket_cap_mb=0.0)  # several buckets: reductions overlap backward
    for params, state, _ in zero_run(
        template, data, zero(torch.optim.AdamW, stage), 2, runner=runner, **caps
    ):
        assert_same(params, expected, f"parameters (stage {stage})")
        assert_same_state(state, expected_state, f"state_dict (stage {stage})")


def bf16_zero2_with_scaler() -> dict[str, torch.Tensor]:
    """bf16 parameters, ZeRO-2 with fp32 master weights, and a LossScaler over its gradient shards."""
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device, torch.bfloat16)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0, first_bucket_cap_mb=0.0)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.01)
    scaler = LossScaler(init_scale=2.0**8)
    for x, y in batches(steps=3, rows=8, n_in=6, n_out=3):
        optimizer.zero_grad()
        x, y = (rank_slice(t, rank, 2).to(device, torch.bfloat16) for t in (x, y))
        scaler.scale_loss(mse(ddp, x, y).float()).backward()
        assert scaler.step(optimizer, optimizer.grad_holders())
    return params_of(model)


def test_zero2_master_weights_and_loss_scaler_on_the_double_match_the_threads_backend():
    expected = run_ranks(bf16_zero2_with_scaler, 2)
    for got, want in zip(run_fake_gpus(bf16_zero2_with_scaler, 2, FakeCuda()), expected):
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)


def fp16_scaled_step(bad_rank: int) -> tuple[bool, float, dict[str, torch.Tensor]]:
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device, torch.float16)
    ddp = DistributedDataParallel(model)
    scaler = LossScaler(init_scale=2.0**10)
    x, y = (t.to(device, torch.float16) for t in batches(steps=1, rows=8, n_in=6, n_out=3)[0])
    scaler.scale_loss(mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).float()).backward()
    if rank == bad_rank:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    stepped = scaler.step(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters())
    return stepped, scaler.scale, params_of(model)


@pytest.mark.parametrize("bad_rank", [-1, 1], ids=["finite", "overflow-on-rank-1"])
def test_fp16_loss_scaler_step_on_the_double_matches_the_threads_backend(bad_rank):
    expected = run_ranks(fp16_scaled_step, 2, bad_rank)
    got = run_fake_gpus(lambda: fp16_scaled_step(bad_rank), 2, FakeCuda())
    for (stepped, scale, params), (want_stepped, want_scale, want) in zip(got, expected):
        assert (
            (stepped, scale)
            == (want_stepped, want_scale)
            == (bad_rank < 0, 2.0**10 if bad_rank < 0 else 2.0**9)
        )
        for name in want:
            torch.testing.assert_close(params[name], want[name], msg=name)


@pytest.mark.parametrize("autograd_thread", THREAD, ids=THREAD_IDS)
def test_zero_bubble_pipeline_with_prefetch_on_the_double_matches_one_thread(autograd_thread):
    inputs, targets = make_batch(8)
    ref_loss, ref_model = pipeline_reference(5, inputs, targets)

    def body():
        device = threadpar.get_device()
        model = make_model(5).to(device)
        chunks = my_chunks(model, 1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule="zbh1", num_microbatches=4, prefetch=True)
        loss = pipe.train_step(inputs.to(device), targets.to(device))
        return {"loss": loss, "grads": my_gradients(model, chunks)}

    fake = FakeCuda(autograd_thread=autograd_thread)
    assert_matches_reference(to_host(run_fake_gpus(body, 2, fake, pp=2)), ref_loss, ref_model)


def autocast_ddp_step() -> dict[str, torch.Tensor]:
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device, torch.float32)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0, first_bucket_cap_mb=0.0)
    x, y = (t.to(device, torch.float32) for t in batches(steps=1, rows=8, n_in=6, n_out=3)[0])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2))
    loss.float().backward()
    return {n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters()}


@pytest.mark.parametrize("autograd_thread", THREAD, ids=THREAD_IDS)
def test_ddp_under_bf16_autocast_on_the_double_matches_the_threads_backend(autograd_thread):
    expected = run_ranks(autocast_ddp_step, 2)
    got = run_fake_gpus(autocast_ddp_step, 2, FakeCuda(autograd_thread=autograd_thread))
    for grads, want in zip(got, expected):
        for name in want:
            torch.testing.assert_close(grads[name], want[name], msg=name)
