"""The selftest's model checks, the same code on any backend: a DDP step, a ZeRO-2 step, an fp16 step under
LossScaler, pipeline steps (1F1B, and zbh1 with its split backward), and DDP and 1F1B steps through
threadpar.graphed_step (CUDA graphs on the nccl backend; eager elsewhere)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.models.gpt import GPT, GPTConfig
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import DistributedDataParallel, LossScaler, ZeroRedundancyOptimizer

MODEL_CHECKS = (
    "ddp_step", "zero2_step", "fp16_scaler_step", "pipeline_step", "zbh1_step", "graphed_steps",
    "graphed_pipeline_steps",
)  # fmt: skip
LABELS = {
    "ddp_step": "DDP step (MLP)",
    "graphed_steps": "DDP steps, CUDA graph",
    "zero2_step": "ZeRO-2 step (MLP, AdamW)",
    "fp16_scaler_step": "fp16 autocast + LossScaler step",
    "pipeline_step": "pipeline step (GPT, 1F1B)",
    "zbh1_step": "pipeline step (GPT, zbh1)",
    "graphed_pipeline_steps": "pipeline steps (GPT, 1F1B), CUDA graph",
}
# Another device computes the same step in another summation order (cuBLAS vs CPU kernels, fp32).
MODEL_TOLERANCE = (1e-4, 1e-5)  # rtol, atol as torch.allclose takes them
# AdamW with capturable=True (on the nccl backend, for the graph) keeps its step size in fp32 tensors where the
# host path computes it in Python floats: 1.1e-5 apart after 5 steps of the GPT below (measured on one thread).
CAPTURABLE_TOLERANCE = (1e-4, 5e-5)
# fp16 matmuls under autocast: another device's kernels round differently in half precision.
FP16_TOLERANCE = (1e-2, 1e-3)
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


GRAPHED_STEPS, GRAPH_WARMUP = 5, 2


def graphed_steps() -> Results:
    """DDP + AdamW steps through threadpar.graphed_step: 2 eager, the capture (and its replay), 2 replays
    (on the nccl backend; elsewhere the step runs eagerly). Returns the losses and the parameters."""
    rank, n, device = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
    model, x, y = _mlp_and_batch(n)
    model = model.to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=threadpar.graphs_here())
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)

    def train(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        threadpar.all_reduce(mean, op="avg")
        return mean

    step = threadpar.graphed_step(train, warmup_steps=GRAPH_WARMUP)
    inputs, targets = x[rows].to(device), y[rows].to(device)
    losses = [step(inputs * (1 + i / 10), targets).clone() for i in range(GRAPHED_STEPS)]
    return {"loss": torch.stack(losses).cpu()} | {
        f"param {k}": p.detach().cpu() for k, p in model.named_parameters()
    }


def graphed_reference(n: int) -> list[Results]:
    model, x, y = _mlp_and_batch(n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for i in range(GRAPHED_STEPS):
        optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x * (1 + i / 10)), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [
        {"loss": torch.stack(losses)} | {f"param {k}": p.detach() for k, p in model.named_parameters()}
    ] * n


def zero2_step() -> Results:
    """DDP + ZeroRedundancyOptimizer(AdamW, stage=2): gradients reduce-scattered into shards during backward,
    then the step and the all-gather of the parameters. Returns the updated parameters."""
    rank, n, device = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
    model, x, y = _mlp_and_batch(n)
    model = model.to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0, first_bucket_cap_mb=0.0)  # a bucket per tensor
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=0.01)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    loss = F.mse_loss(ddp(x[rows].to(device)), y[rows].to(device))
    loss.backward()
    optimizer.step()
    return {f"param {k}": p.detach().cpu() for k, p in model.named_parameters()}


def zero2_reference(n: int) -> list[Results]:
    model, x, y = _mlp_and_batch(n)
    F.mse_loss(model(x), y).backward()
    torch.optim.AdamW(model.parameters(), lr=0.01).step()
    return [{f"param {k}": p.detach() for k, p in model.named_parameters()}] * n


def fp16_scaler_step() -> Results:
    """fp32 parameters, forward under fp16 autocast, the loss scaled by LossScaler, its one-sync step."""
    rank, n, device = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
    model, x, y = _mlp_and_batch(n)
    model = model.to(device)
    ddp = DistributedDataParallel(model)
    scaler = LossScaler(init_scale=2.0**12)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = F.mse_loss(ddp(x[rows].to(device)).float(), y[rows].to(device))
    scaler.scale_loss(loss).backward()
    grads = {
        f"grad {k}": p.grad.detach().cpu().clone() for k, p in model.named_parameters() if p.grad is not None
    }
    if not scaler.step(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters()):
        return {"loss": loss.detach().cpu(), "skipped": torch.ones(1)}  # a finite step must not skip
    grads = {k: g / scaler.scale for k, g in grads.items()}  # (the scale has not grown: growth_interval 200)
    return {f"param {k}": p.detach().cpu() for k, p in model.named_parameters()} | grads


def fp16_scaler_reference(n: int) -> list[Results]:
    model, x, y = _mlp_and_batch(n)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    grads = {f"grad {k}": p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [{f"param {k}": p.detach() for k, p in model.named_parameters()} | grads] * n


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


def pipeline_step(schedule: str = "1f1b") -> Results:
    """On each rank, one stage of a GPT cut into world-size stages: one step of 2 x pp microbatches;
    the loss every stage reports (the last stage's, shared) and this stage's gradients."""
    n, device = threadpar.get_world_size(), threadpar.get_device()
    config, dense, inputs, targets = _gpt(n)
    model = parallelize_gpt(config, dense, schedule=schedule, num_microbatches=2 * n)
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


def graphed_pipeline_steps() -> Results:
    """A GPT cut into world-size stages, AdamW steps through threadpar.graphed_step (the stages' sends and
    receives in the graph): 2 eager, the capture, 2 replays. Returns the losses and this stage's parameters."""
    n, device = threadpar.get_world_size(), threadpar.get_device()
    config, dense, inputs, targets = _gpt(n)
    model = parallelize_gpt(config, dense, schedule="1f1b", num_microbatches=2 * n)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=0.01, capturable=threadpar.graphs_here())

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=False)
        loss = model.train_step(x, y)
        optimizer.step()
        return loss.detach()

    step = threadpar.graphed_step(train, warmup_steps=GRAPH_WARMUP)
    batches = [((inputs + i) % config.vocab_size, targets) for i in range(GRAPHED_STEPS)]
    losses = [step(x.to(device), y.to(device)).clone() for x, y in batches]
    params = {f"param {k}": t.cpu() for k, t in model.dense_state().items()}
    return {"loss": torch.stack(losses).cpu(), **params}


def graphed_pipeline_reference(n: int) -> list[Results]:
    config, dense, inputs, targets = _gpt(n)
    model = GPT(config)
    model.load_state_dict(dense)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for i in range(GRAPHED_STEPS):
        optimizer.zero_grad(set_to_none=False)
        loss = model.loss((inputs + i) % config.vocab_size, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    params = {f"param {k}": t.detach() for k, t in model.state_dict().items()}
    return [{"loss": torch.stack(losses), **params}] * n  # each rank is compared on the names it holds


def compare_results(got: Results, want: Results, tolerance: tuple[float, float] = MODEL_TOLERANCE) -> str:
    for name, tensor in got.items():
        if name not in want:
            return f"FAIL (unexpected {name})"
        if tensor.shape != want[name].shape or not torch.allclose(tensor, want[name], *tolerance):
            diff = (tensor - want[name]).abs().max().item() if tensor.shape == want[name].shape else "shape"
            return f"FAIL ({name}: max |diff| {diff})"
    if not any(name == "loss" or name.startswith("param ") for name in got):
        return "FAIL (no loss and no parameters)"
    return "pass"


def check_models(subject: LayoutRunner, reference: LayoutRunner | None, n: int) -> list[tuple]:
    """Table rows (as selftest.check's) for the DDP and the pipeline step: `subject` against `reference` (another
    backend) or, when None, against the same step on this thread."""
    zbh1 = functools.partial(pipeline_step, "zbh1")
    steps: dict[str, tuple[Callable, Callable, dict, tuple[float, float]]] = {
        "ddp_step": (ddp_step, ddp_reference, {}, MODEL_TOLERANCE),
        "zero2_step": (zero2_step, zero2_reference, {}, MODEL_TOLERANCE),
        "fp16_scaler_step": (fp16_scaler_step, fp16_scaler_reference, {}, FP16_TOLERANCE),
        "pipeline_step": (pipeline_step, pipeline_reference, {"pp": n}, MODEL_TOLERANCE),
        "zbh1_step": (zbh1, pipeline_reference, {"pp": n}, MODEL_TOLERANCE),
        "graphed_steps": (graphed_steps, graphed_reference, {}, MODEL_TOLERANCE),
        "graphed_pipeline_steps": (
            graphed_pipeline_steps,
            graphed_pipeline_reference,
            {"pp": n},
            CAPTURABLE_TOLERANCE,
        ),
    }
    rows = []
    for name, (step, direct, layout, tolerance) in steps.items():
        got = subject(step, **layout)
        want = reference(step, **layout) if reference is not None else direct(n)
        verdicts = [compare_results(g, w, tolerance) for g, w in zip(got, want)]
        failed = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v != "pass"), "pass")
        rows.append((name, "-", failed, None, float("nan"), float("nan")))
    return rows
