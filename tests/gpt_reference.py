"""The single-thread oracle for GPT parity tests: one plain model, one batch, its loss and gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threadpar.models.gpt import GPT, GPTConfig

SMALL = GPTConfig(n_layer=8, n_head=8, n_embd=32, block_size=16)


@dataclass
class Reference:
    config: GPTConfig
    dense: dict[str, torch.Tensor]  # the initial weights every layout loads
    inputs: torch.Tensor  # [B, T]
    targets: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def reference(
    config: GPTConfig = SMALL, batch: int = 16, seed: int = 0, autocast: torch.dtype | None = None
) -> Reference:
    g = torch.Generator().manual_seed(seed)
    model = GPT(config, autocast_dtype=autocast).init_weights(g)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    loss = model.loss(inputs, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return Reference(config, dense, inputs, targets, loss.detach(), grads)


def dp_slice(t: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    per = t.shape[0] // dp
    return t[dp_rank * per : (dp_rank + 1) * per]
