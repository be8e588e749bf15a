"""What benchmarks.gpu measures, written once for both sides: threadpar's rank threads and torch.distributed
processes call the same functions with their own `api` (the module whose all_reduce/barrier they use)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from threadpar.models.gpt import GPT, model_config

MIB = 1 << 20
ALL_REDUCE_SIZES = (1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)


@dataclass(frozen=True)
class GptShape:
    size: str  # threadpar.models.config.MODEL_SIZES
    seq_len: int
    batch_per_rank: int

    def tokens_per_step(self, world: int) -> int:
        return world * self.batch_per_rank * self.seq_len

    def as_arg(self) -> str:
        return f"{self.size},{self.seq_len},{self.batch_per_rank}"

    @staticmethod
    def parse(text: str) -> GptShape:
        size, seq_len, batch = text.split(",")
        return GptShape(size, int(seq_len), int(batch))


GPU_GPT = GptShape("medium", 256, 16)  # 12 layers x 256 wide; 4096 tokens per GPU and step
SMOKE_GPT = GptShape("tiny", 32, 2)  # the --cpu smoke run


def all_reduce_bus_factor(n: int) -> float:
    """nccl-tests' busbw / algbw for all-reduce (doc/PERFORMANCE.md): 2 (n - 1) / n."""
    return 2 * (n - 1) / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    step: Callable[[], Any], device: torch.device, barrier: Callable[[], Any], iters: int, repeats: int
) -> float:
    """Median over `repeats` of seconds per call, each repeat `iters` calls ended by a device sync; every rank
    starts a repeat together (the barrier) and the slowest rank's time is what the caller takes."""
    samples = []
    for _ in range(repeats):
        _sync(device)
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def all_reduce_times(
    api: Any, device: torch.device, world: int, sizes: list[int], repeats: int
) -> dict[str, float]:
    """Seconds per all-reduce of each size (float32). The first result is checked: a fast wrong answer is no
    benchmark."""
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=device)
        api.all_reduce(t)
        if t[0].item() != world:
            raise RuntimeError(f"all_reduce of ones over {world} ranks gave {t[0].item()}")
        iters = 20 if nbytes <= 16 * MIB else 5
        out[str(nbytes)] = timed(functools.partial(api.all_reduce, t), device, api.barrier, iters, repeats)
    return out


def gpt_batch(
    shape: GptShape, rank: int, device: torch.device, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, vocab, (shape.batch_per_rank, shape.seq_len + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)  # inputs and next-token targets [B, T]


def ddp_gpt_step_time(
    wrap: Callable[[nn.Module], nn.Module],
    api: Any,
    shape: GptShape,
    rank: int,
    device: torch.device,
    steps: int,
    repeats: int,
) -> float:
    """Seconds per DDP training step of the GPT (forward through the wrapper, backward with its gradient
    averaging, AdamW) on this rank's batch."""
    config = model_config(shape.size, block_size=shape.seq_len)
    model = GPT(config).init_weights(torch.Generator().manual_seed(0)).to(device)
    ddp = wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = gpt_batch(shape, rank, device, config.vocab_size)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(x)  # [B, T, vocab]
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()

    for _ in range(2):
        step()  # warm-up: communicators, buckets rebuilt in ready order, allocator
    return timed(step, device, api.barrier, steps, repeats)
