"""The single-thread oracle for GPT parity tests: one plain model, one batch, its loss and gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import threadpar
from threadpar.models.gpt import GPT, GPTConfig
from threadpar.models.parallelize_gpt import parallelize_gpt

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


def hybrid_step(ref, schedule, microbatches, **options):
    """Every rank: build its part, run one step on its DP slice; return (loss, this stage's dense grads)."""
    layout, coords = threadpar.get_layout(), threadpar.get_coords()
    model = parallelize_gpt(
        ref.config, ref.dense, schedule=schedule, num_microbatches=microbatches, **options
    )
    device = threadpar.get_device()  # a GPU in the cuda tier (tests/cuda/); results come back on the CPU
    x = dp_slice(ref.inputs, coords.dp, layout.dp).to(device)
    y = dp_slice(ref.targets, coords.dp, layout.dp).to(device)
    loss = model.train_step(x, y)
    threadpar.all_reduce(loss, op="avg", group="DP")
    grads = {name: None if g is None else g.cpu() for name, g in model.dense_grads().items()}
    return loss.cpu(), grads


def check_against(ref, results, *, rtol=1e-4, atol=1e-6):
    covered = set()
    for loss, grads in results:
        torch.testing.assert_close(loss, ref.loss, rtol=rtol, atol=atol)
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, ref.grads[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )
            covered.add(name)
    assert covered == set(ref.grads), "every parameter's gradient must be checked on some rank"


def train_losses(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches,
    steps: int,
    max_norm: float | None = None,
) -> list[float]:
    """Train `model` (a plain GPT) on this thread on batches.batch(step) for each step; the loss of each.
    max_norm: clip the gradient norm with torch's clip_grad_norm_ before each step."""
    losses = []
    for step in range(steps):
        loss = model.loss(*batches.batch(step))
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
