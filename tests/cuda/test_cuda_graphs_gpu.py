"""The GPU tier of threadpar.graphed_step (issue 33): real CUDA graph captures on rank threads, against the
single-thread model. Skipped without GPUs (tests/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.ddp_reference import batches, mlp, rank_slice
from helpers.gpus import gpus_or_skip, run_gpus

import threadpar
from threadpar.errors import GraphCaptureError
from threadpar.parallel import DistributedDataParallel

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
TEMPLATE = mlp()
STEPS, WARMUP = 6, 2


def graphed_run(n: int) -> dict:
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)

    def train(x, y):
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    step = threadpar.graphed_step(train, warmup_steps=WARMUP)
    for x, y in batches(steps=STEPS, rows=4 * n, n_in=6, n_out=3):
        step(*(rank_slice(t, rank, n).to(device) for t in (x, y)))
    return {"replays": step.replays, "params": [p.detach().cpu() for p in model.parameters()]}


def test_graphed_ddp_steps_on_every_gpu_match_one_thread():
    n = gpus_or_skip(1)
    model = copy.deepcopy(TEMPLATE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches(steps=STEPS, rows=4 * n, n_in=6, n_out=3):
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(
            model(x.to(TEMPLATE[0].weight.dtype)), y.to(TEMPLATE[0].weight.dtype)
        ).backward()
        optimizer.step()
    for result in run_gpus(graphed_run, n, n):
        assert result["replays"] == STEPS - WARMUP
        for got, want in zip(result["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_host_read_is_refused_at_capture_on_a_gpu():
    gpus_or_skip(1)

    def body():
        step = threadpar.graphed_step(lambda x: x * float(x.sum()), warmup_steps=1)
        t = torch.ones(4, device=threadpar.get_device())
        step(t)
        step(t)

    with pytest.raises((GraphCaptureError, RuntimeError), match="captur"):
        run_gpus(body, 1)
