"""Tiny models and single-thread references for the tests of torch's own parallelism on rank threads."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

D_IN, D_HID, D_OUT = 8, 16, 4


class MLP(nn.Module):
    """in_proj -> relu -> out_proj: ColwiseParallel/RowwiseParallel's canonical pair."""

    def __init__(self, d_in: int = D_IN, d_hid: int = D_HID, d_out: int = D_OUT) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_in, d_hid)
        self.out_proj = nn.Linear(d_hid, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class Block(nn.Module):
    """LayerNorm then an MLP with a residual: SequenceParallel's norm and the TP pair around it."""

    def __init__(self, d: int = D_IN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, 2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    """`module` with parameters drawn from its own generator (never the process's shared one, rule 3)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def batch(rows: int, cols: int = D_IN, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def reference_steps(
    template: nn.Module, inputs: list[torch.Tensor], loss: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Parameters after one SGD step per input on one thread (the dense run the parallel ones must match)."""
    model = copy.deepcopy(template)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in inputs:
        loss(model(x)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor (a DTensor's full value)."""
    return p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
