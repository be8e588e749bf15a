"""Shared by the DDP tests: a small model, per-step data, and the single-thread reference they must match.

The parity oracle: P ranks with per-rank batch b (rank r takes rows r*b .. (r+1)*b of the global batch)
against one thread on the whole batch P*b. Losses are means over the batch, so DDP's average of the
per-rank gradients equals the reference gradient. Models are built in the test's thread and deep-copied
by each rank, so no rank touches the global RNG (DESIGN.md rule 3).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn

import threadpar
from threadpar.parallel import DistributedDataParallel
from threadpar.testing import run_ranks

DTYPE = torch.float64  # parity down to rounding of a different summation order


def mlp(seed: int = 0, widths: tuple[int, ...] = (6, 10, 8, 3)) -> nn.Module:
    torch.manual_seed(seed)  # the test's thread only, before any rank starts
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(DTYPE)


def batches(steps: int, rows: int, n_in: int, n_out: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(rows, n_in, generator=g, dtype=DTYPE),
            torch.randn(rows, n_out, generator=g, dtype=DTYPE),
        )
        for _ in range(steps)
    ]


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = t.shape[0] // world
    return t[rank * b : (rank + 1) * b]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Copies on the CPU (where the single-thread reference runs), also of a model on a GPU."""
    return {
        n: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
        for n, p in model.named_parameters()
    }


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def reference_run(template: nn.Module, data, make_optimizer: OptimizerFactory, loss=mse) -> tuple[dict, dict]:
    """Gradients after the first step and parameters after all steps, on one thread, whole batches."""
    model = copy.deepcopy(template)
    optimizer = make_optimizer(list(model.parameters()))
    first_grads = None
    for x, y in data:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        first_grads = first_grads or grads_of(model)
        optimizer.step()
    return first_grads, params_of(model)


def ddp_run(
    template: nn.Module,
    data,
    make_optimizer: OptimizerFactory,
    world: int,
    loss=mse,
    runner: Callable[[Callable, int], list] = run_ranks,
    **ddp_kwargs,
) -> list[tuple[dict, dict]]:
    """The same on `world` rank threads with DDP; per rank: (first-step gradients, final parameters)."""

    def body():
        # the rank's device: a GPU in the cuda tier (tests/cuda/), the double's simgpu on its launches
        rank, device = threadpar.get_rank(), threadpar.get_device()
        model = copy.deepcopy(template).to(device)
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        optimizer = make_optimizer(list(model.parameters()))
        first_grads = None
        for x, y in data:
            optimizer.zero_grad()
            mine = rank_slice(x, rank, world).to(device), rank_slice(y, rank, world).to(device)
            loss(ddp, *mine).backward()
            first_grads = first_grads or grads_of(model)
            optimizer.step()
        return first_grads, params_of(model)

    return runner(body, world)


def assert_same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if expected[name] is None or actual[name] is None:
            assert actual[name] is None and expected[name] is None, f"{what} of {name}: one is None"
        else:
            torch.testing.assert_close(
                actual[name], expected[name], msg=lambda m, n=name: f"{what} of {n}: {m}"
            )
