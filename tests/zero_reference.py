"""Shared by the ZeRO tests: DDP + ZeroRedundancyOptimizer runs of the DDP tests' MLP, per rank."""

from __future__ import annotations

import copy
from functools import partial

import torch
from ddp_reference import mse, params_of, rank_slice

import threadpar
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from threadpar.testing import run_ranks


def adamw(params, cls=torch.optim.AdamW):
    return cls(params, lr=0.01, weight_decay=0.1)


def sgd(params, cls=torch.optim.SGD):
    return cls(params, lr=0.1, momentum=0.9)


def zero_adamw(params, stage):
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1)


def zero_sgd(params, stage):
    return ZeroRedundancyOptimizer(params, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)


ZERO = {"adamw": (adamw, zero_adamw), "sgd": (sgd, zero_sgd)}


def zero_run(template, data, make_zero, stage, world, **ddp_kwargs):
    """Per rank: (final parameters, the optimizer's state bytes, the dense state_dict)."""

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        optimizer = make_zero(list(model.parameters()), stage)
        for x, y in data:
            optimizer.zero_grad()
            mse(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            optimizer.step()
        return params_of(model), optimizer.state_bytes(), optimizer.state_dict()

    return run_ranks(body, world)


def zero_factory(name: str):
    return partial(ZERO[name][1])
