"""The selftest's model checks: one DDP step and one pipeline step, the same code on any backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.models.gpt import GPT, GPTConfig
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import DistributedDataParallel

MODEL_CHECKS = ("ddp_step", "pipeline_step")
LABELS = {"ddp_step": "DDP step (MLP)", "pipeline_step": "pipeline step (GPT, 1F1B)"}
# Another device computes the same step in another summation order (cuBLAS vs CPU kernels, fp32).
MODEL_TOLERANCE = (1e-4, 1e-5)  # rtol, atol as torch.allclose takes them
ROWS_PER_RANK = 4
Results = dict[str, torch.Tensor]  # named tensors, on the CPU
LayoutRunner = Callable[..., list[Any]]  # runner(fn, **layout): fn on every rank, the per-rank results


def _mlp_and_batch(n: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x, y = torch.randn(ROWS_PER_RANK * n, 16, generator=g), torch.randn(ROWS_PER_RANK * n, 4, generator=g)
    return model, x, y


def _step_results(model: nn.Module, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Results:
    out = {"loss": loss.detach().cpu()}
    out |= {f"grad {k}": p.grad.detach().cpu() for k, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return out | {f"param {k}": p.detach().cpu() for k, p in model.named_parameters()}


def ddp_step() -> Results:
    """On each rank: DDP over the world, one SGD step on this rank's rows of a fixed batch."""
    rank, n, device = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
    model, x, y = _mlp_and_batch(n)
    with torch.no_grad():  # DDP must replace these with rank 0's weights (its initial broadcast)
        for p in model.parameters():
            p.add_(rank)
    model = model.to(device)
    ddp = DistributedDataParallel(model)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    loss = F.mse_loss(ddp(x[rows].to(device)), y[rows].to(device))
    loss.backward()  # gradients averaged over the world
    threadpar.all_reduce(loss.detach(), op="avg")
    return _step_results(model, loss, torch.optim.SGD(model.parameters(), lr=0.1))


def ddp_reference(n: int) -> list[Results]:
    """The same step on this thread, on the whole batch: what every rank must hold."""
    model, x, y = _mlp_and_batch(n)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return [_step_results(model, loss, torch.optim.SGD(model.parameters(), lr=0.1))] * n


def _gpt(n: int) -> tuple[GPTConfig, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=n, n_head=2, n_embd=16)
    g = torch.Generator().manual_seed(1)
    dense = GPT(config).init_weights(g).state_dict()
    inputs = torch.randint(0, config.vocab_size, (4 * n, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (4 * n, config.block_size), generator=g)
    return config, dense, inputs, targets


def pipeline_step() -> Results:
    """On each rank, one stage of a GPT cut into world-size stages: one 1F1B step of 2 x pp microbatches;
    the loss every stage reports (the last stage's, shared) and this stage's gradients."""
    n, device = threadpar.get_world_size(), threadpar.get_device()
    config, dense, inputs, targets = _gpt(n)
    model = parallelize_gpt(config, dense, schedule="1f1b", num_microbatches=2 * n)
    loss = model.train_step(inputs.to(device), targets.to(device))
    grads = {f"grad {k}": g.cpu() for k, g in model.dense_grads().items() if g is not None}
    return {"loss": loss.detach().cpu(), **grads}


def pipeline_reference(n: int) -> list[Results]:
    config, dense, inputs, targets = _gpt(n)
    model = GPT(config)
    model.load_state_dict(dense)
    loss = model.loss(inputs, targets)
    loss.backward()
    grads = {f"grad {k}": p.grad for k, p in model.named_parameters() if p.grad is not None}
    whole = {"loss": loss.detach(), **grads}
    return [whole] * n  # each rank is compared on the names it holds


def compare_results(got: Results, want: Results) -> str:
    for name, tensor in got.items():
        if name not in want:
            return f"FAIL (unexpected {name})"
        if tensor.shape != want[name].shape or not torch.allclose(tensor, want[name], *MODEL_TOLERANCE):
            diff = (tensor - want[name]).abs().max().item() if tensor.shape == want[name].shape else "shape"
            return f"FAIL ({name}: max |diff| {diff})"
    return "pass" if "loss" in got else "FAIL (no loss)"


def check_models(subject: LayoutRunner, reference: LayoutRunner | None, n: int) -> list[tuple]:
    """Table rows (as selftest.check's) for the DDP and the pipeline step: `subject` against `reference` (another
    backend) or, when None, against the same step on this thread."""
    steps = {
        "ddp_step": (ddp_step, ddp_reference, {}),
        "pipeline_step": (pipeline_step, pipeline_reference, {"pp": n}),
    }
    rows = []
    for name, (step, direct, layout) in steps.items():
        got = subject(step, **layout)
        want = reference(step, **layout) if reference is not None else direct(n)
        verdicts = [compare_results(g, w) for g, w in zip(got, want)]
        failed = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v != "pass"), "pass")
        rows.append((name, "-", failed, None, float("nan"), float("nan")))
    return rows
