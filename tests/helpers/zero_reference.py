"""Shared by the ZeRO tests: DDP + ZeroRedundancyOptimizer runs of the DDP tests' MLP, and the one-thread
runs of the same recipe they must match."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import threadpar
from helpers.ddp_reference import mse, params_of, rank_slice
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from threadpar.testing import run_ranks

HYPER = {torch.optim.AdamW: dict(lr=0.01, weight_decay=0.1), torch.optim.SGD: dict(lr=0.1, momentum=0.9)}


def plain(cls: type) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: cls(params, **HYPER[cls])


def zero(cls: type, stage: int, **kwargs) -> Callable[[list[nn.Parameter]], ZeroRedundancyOptimizer]:
    return lambda params: ZeroRedundancyOptimizer(params, cls, stage=stage, **HYPER[cls], **kwargs)


def reference(template: nn.Module, data, make_optimizer, state: dict | None = None):
    """One thread, whole batches: (final parameters, the optimizer's state_dict, its state bytes)."""
    from threadpar.parallel import optimizer_state_bytes

    model = copy.deepcopy(template)
    optimizer = make_optimizer(list(model.parameters()))
    if state is not None:
        optimizer.load_state_dict(state)
    for x, y in data:
        optimizer.zero_grad()
        mse(model, x, y).backward()
        optimizer.step()
    return params_of(model), optimizer.state_dict(), optimizer_state_bytes(optimizer)


def zero_run(
    template: nn.Module,
    data,
    make_optimizer,
    world: int,
    *,
    state: dict | None = None,
    accumulate: int = 1,
    start: dict | None = None,
    runner: Callable = run_ranks,
    **ddp_kwargs,
):
    """The same on `world` rank threads with DDP, on each rank's device; per rank: (final parameters,
    state_dict, state bytes), parameters and state copied to the host. accumulate: micro-batches per step, all
    but the last backward under no_sync(). start: initial weights. runner(body, world): runs the ranks
    (default: threadpar.testing.run_ranks, the threads backend)."""

    def body():
        rank, device = threadpar.get_rank(), threadpar.get_device()
        model = copy.deepcopy(template).to(device)
        if start is not None:
            model.load_state_dict(start)
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        optimizer = make_optimizer(list(model.parameters()))
        if state is not None:
            optimizer.load_state_dict(state)
        for x, y in data:
            optimizer.zero_grad()
            xs, ys = (
                rank_slice(x, rank, world).to(device).chunk(accumulate),
                rank_slice(y, rank, world).to(device).chunk(accumulate),
            )
            for k, (xk, yk) in enumerate(zip(xs, ys)):
                sync = k == accumulate - 1
                with ddp.no_sync() if not sync else _nothing():
                    (mse(ddp, xk, yk) / accumulate).backward()
            optimizer.step()
        from threadpar.parallel import optimizer_state_bytes

        return params_of(model), state_on_host(optimizer.state_dict()), optimizer_state_bytes(optimizer)

    return runner(body, world)


def state_on_host(state: dict) -> dict:
    """An optimizer state_dict with its per-parameter tensors copied to the host (for host references)."""
    return {
        **state,
        "state": {
            index: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for index, entry in state["state"].items()
        },
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def assert_same_state(actual: dict, expected: dict, what: str, **tol) -> None:
    """Two optimizer state_dicts hold the same per-parameter state (dense, indexed alike)."""
    assert actual["state"].keys() == expected["state"].keys(), what
    for index, entry in expected["state"].items():
        assert actual["state"][index].keys() >= entry.keys(), f"{what}: keys of parameter {index}"
        for key, value in entry.items():
            torch.testing.assert_close(
                actual["state"][index][key],
                value,
                **tol,
                msg=lambda m, i=index, k=key: f"{what} {i}.{k}: {m}",
            )
