"""The distributed optimizer: optimizer-state memory per rank and step time, threadpar vs torch over gloo.

    python -m benchmarks.zero            # full run
    python -m benchmarks.zero --quick    # 2 rounds, fewer steps (a smoke run)

Side by side, on 2 ranks (--ranks), for two models: the DDP benchmark's MLP (4 x Linear(1024, 1024), batch
64 per rank) and the GPT ('medium': 12 layers, 256 wide, batch 4 x 128 tokens per rank). A step is
zero_grad, forward, backward (gradients averaged), the AdamW step:

- threadpar DDP + torch.optim.AdamW (every rank holds the whole state and runs the whole step)
- threadpar DDP + ZeroRedundancyOptimizer(AdamW, stage=1) and stage=2
- torch DDP + torch.optim.AdamW over gloo, one process per rank (the factor threadpar DDP is faster by)
- torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW) over gloo, one process per rank

State per rank is measured from the optimizer's state tensors after the last step (rank 0; torch's
ZeroRedundancyOptimizer: its local `.optim`). Times: the median over interleaved rounds of the median of
repeats of the mean of `iters` steps on rank 0, so load from other work hits every configuration alike.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_time, machine_line, median_time, run_gloo, table
from threadpar.models.gpt import GPT, model_config
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer, optimizer_state_bytes

WIDTH, LAYERS, MLP_BATCH = 1024, 4, 64
GPT_SIZE, GPT_BATCH, GPT_SEQ = "medium", 4, 128
HYPER: dict[str, Any] = dict(lr=1e-4, weight_decay=0.0)
THREADPAR = {"threadpar DDP + AdamW": 0, "threadpar ZeRO-1": 1, "threadpar ZeRO-2": 2}
GLOO = {"torch DDP + AdamW, gloo": False, "torch ZeroRedundancyOptimizer, gloo": True}


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "gpt":
        return GPT(model_config(GPT_SIZE, block_size=GPT_SEQ)).init_weights(torch.Generator().manual_seed(0))
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batch(model: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if model == "gpt":
        shape = (GPT_BATCH, GPT_SEQ)
        return torch.randint(0, 256, shape, generator=generator), torch.randint(
            0, 256, shape, generator=generator
        )
    return torch.randn(MLP_BATCH, WIDTH, generator=generator), torch.randn(
        MLP_BATCH, WIDTH, generator=generator
    )


def loss_of(
    model: str, module: nn.Module, wrapped: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    if model == "gpt":  # GPT.loss bypasses DDP's forward; the forward through the wrapper gives the logits
        logits = wrapped(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(wrapped(x), y)


def make_step(model: str, module: nn.Module, wrapped: nn.Module, optimizer, generator) -> Callable[[], None]:
    x, y = batch(model, generator)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(model, module, wrapped, x, y).backward()
        optimizer.step()

    return step


def _barrier() -> None:
    threadpar.barrier()


def threadpar_rank(
    template: nn.Module, model: str, stage: int, iters: int, repeats: int
) -> tuple[float, int]:
    module = copy.deepcopy(template)
    wrapped = DistributedDataParallel(module)
    optimizer: torch.optim.Optimizer
    if stage:
        optimizer = ZeroRedundancyOptimizer(module.parameters(), torch.optim.AdamW, stage=stage, **HYPER)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), **HYPER)
    step = make_step(model, module, wrapped, optimizer, threadpar.get_generator())
    for _ in range(3):
        step()  # warm-up: state allocated, DDP's buckets rebuilt
    seconds = median_time(step, iters=iters, repeats=repeats, sync=_barrier)
    return seconds, optimizer_state_bytes(optimizer)


def gloo_rank(rank: int, world: int, model: str, zero: bool, iters: int, repeats: int) -> tuple[float, int]:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    module = build(model)
    wrapped = TorchDDP(module)
    optimizer: torch.optim.Optimizer
    if zero:
        optimizer = TorchZero(module.parameters(), optimizer_class=torch.optim.AdamW, **HYPER)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), **HYPER)
    step = make_step(model, module, wrapped, optimizer, torch.Generator().manual_seed(rank))
    for _ in range(3):
        step()
    return median_time(step, iters=iters, repeats=repeats, sync=dist.barrier), optimizer_state_bytes(
        optimizer
    )


def measure_round(model: str, template: nn.Module, ranks: int, iters: int, repeats: int) -> dict[str, tuple]:
    """Every configuration once (rounds interleave them)."""
    out: dict[str, tuple] = {}
    for name, zero in GLOO.items():
        out[name] = tuple(run_gloo(gloo_rank, ranks, model, zero, iters, repeats))
    for name, stage in THREADPAR.items():
        out[name] = threadpar.launch(
            threadpar_rank,
            template,
            model,
            stage,
            iters,
            repeats,
            world_size=ranks,
            devices="cpu",
            rank_cores=EVERY_CORE,
        )[0]
    return out


def report(model: str, ranks: int, rounds: list[dict[str, tuple]]) -> None:
    step = {name: statistics.median(r[name][0] for r in rounds) for name in rounds[0]}
    state = {name: rounds[-1][name][1] for name in rounds[0]}
    ddp, zero1, zero2 = "threadpar DDP + AdamW", "threadpar ZeRO-1", "threadpar ZeRO-2"
    gloo_ddp, gloo_zero = "torch DDP + AdamW, gloo", "torch ZeroRedundancyOptimizer, gloo"
    rows = []
    for name in [*THREADPAR, *GLOO]:
        low, high = min(r[name][0] for r in rounds), max(r[name][0] for r in rounds)
        rows.append(
            [
                name,
                f"{state[name] / 2**20:.2f} MiB",
                f"{state[name] / state[ddp]:.3f}",
                fmt_time(step[name]),
                f"{fmt_time(low)} .. {fmt_time(high)}",
                f"{step[name] / step[ddp]:.2f}x",
            ]
        )
    headers = [
        "configuration",
        "optimizer state / rank",
        "vs DDP",
        "step",
        "range over rounds",
        "step vs DDP",
    ]
    print(table(headers, rows))
    ddp_factor = step[gloo_ddp] / step[ddp]
    print(
        f"\nGoals: state per rank = 1/{ranks} of DDP's ({1 / ranks:.3f}): ZeRO-1 {state[zero1] / state[ddp]:.3f}, "
        f"ZeRO-2 {state[zero2] / state[ddp]:.3f}; ZeRO-1 step <= 1.1x threadpar DDP's: "
        f"{step[zero1] / step[ddp]:.2f}x (ZeRO-2 {step[zero2] / step[ddp]:.2f}x); faster than torch's ZeRO over "
        f"gloo by at least DDP's factor ({ddp_factor:.2f}x): ZeRO-1 {step[gloo_zero] / step[zero1]:.2f}x, "
        f"ZeRO-2 {step[gloo_zero] / step[zero2]:.2f}x\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over all configurations")
    parser.add_argument("--iters", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per configuration and round")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 repeats of 2 steps")
    args = parser.parse_args()
    rounds, iters, repeats = (2, 2, 2) if args.quick else (args.rounds, args.iters, args.repeats)
    print(f"# ZeRO: {args.ranks} ranks ({machine_line()}); load average at start {os.getloadavg()[0]:.1f}")
    print(f"# median over {rounds} rounds of the median of {repeats} repeats of the mean of {iters} steps\n")
    for model in args.models.split(","):
        template = build(model)
        params = sum(p.numel() for p in template.parameters())
        what = f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {MLP_BATCH}"
        if model == "gpt":
            what = f"GPT '{GPT_SIZE}', batch {GPT_BATCH} x {GPT_SEQ} tokens"
        print(f"## {what} per rank, {params / 1e6:.2f}M parameters, AdamW\n")
        report(
            model,
            args.ranks,
            [measure_round(model, template, args.ranks, iters, repeats) for _ in range(rounds)],
        )
    print(f"# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
