"""Whole-step CUDA graphs on rank threads (threadpar.graphed_step), over the double's capture and replay
(fakes/fake_graph.py): graphed runs against eager single-thread references, and what a capture refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar import GraphCaptureError
from threadpar.parallel import DistributedDataParallel

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("capturable_on_cpu")]

STEPS = 8


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """The double's tensors stand for CUDA ones: torch's capturable optimizers accept them (torch/optim/
    optimizer.py, _get_capturable_supported_devices, imported by name into torch/optim/adam.py)."""
    import importlib

    modules = [importlib.import_module(f"torch.optim.{name}") for name in ("optimizer", "adam")]
    devices = [*modules[0]._get_capturable_supported_devices(), "cpu"]
    for module in modules:
        monkeypatch.setattr(module, "_get_capturable_supported_devices", lambda supports_xla=True: devices)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def data(world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)) for _ in range(steps)]


def reference(template: torch.nn.Module, batches, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One thread, the whole batch: the losses (mean of the ranks' losses) and the parameters at the end."""
    model = copy.deepcopy(template)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        per_rank = [torch.nn.functional.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world), y.chunk(world))]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, [p.detach() for p in model.parameters()]


def ddp_body(template, batches, warmup, graphed=True):
    def body():
        rank, world = threadpar.get_rank(), threadpar.get_world_size()
        model = DistributedDataParallel(copy.deepcopy(template))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            everyone = loss.detach().clone()
            threadpar.all_reduce(everyone)
            return everyone / world

        step = threadpar.graphed_step(train, warmup_steps=warmup) if graphed else train
        losses = []
        for x, y in batches:
            losses.append(step(x.chunk(world)[rank], y.chunk(world)[rank]).clone())
        return losses, [p.detach().clone() for p in model.parameters()], step

    return body


@pytest.mark.parametrize("warmup", [1, 3])
def test_a_graphed_ddp_step_matches_eager_single_thread(warmup):
    template, batches = mlp(), data(2)
    losses, params = reference(template, batches, 2)
    fake = FakeCuda()
    results = run_fake_gpus(ddp_body(template, batches, warmup), 2, fake)
    for got_losses, got_params, step in results:
        assert step.replays == STEPS - warmup
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses))
        for got, want in zip(got_params, params):
            torch.testing.assert_close(got, want)
    assert fake.races == []
