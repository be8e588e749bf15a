"""ZeRO's memory: the peak resident memory of a fresh process per configuration, DDP vs ZeRO-1 vs ZeRO-2.

    python -m benchmarks.zero_memory               # 5 rounds
    python -m benchmarks.zero_memory --rounds 3

Each measurement is one fresh Python process (so nothing freed earlier lowers a later peak): 2 rank threads
(--ranks) on the threads backend, each with its own MLP of 8 x Linear(2048, 2048) (128 MiB of fp32
gradients per rank), threadpar DDP, AdamW, 2 steps of batch 16 per rank; it prints the process's peak RSS
(getrusage's ru_maxrss). The three configurations run interleaved, round after round, and the table shows
the median over rounds. Each runs twice: with glibc malloc as it comes, and with MALLOC_MMAP_THRESHOLD_
fixed at 1 MiB, so that every large block is mapped on allocation and unmapped on free. glibc's default
raises its mmap threshold to the size of the last large block freed (up to 32 MiB, mallopt(3)), after which
16 MiB gradients come from the heap and their freed space stays resident: the default column includes that
retention, the fixed one measures what the tensors alive at the peak hold. The goals (issue 22): ZeRO-2's peak below ZeRO-1's by at least a third of one rank's
gradient bytes per rank, and ZeRO-1's below DDP's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

import torch
from torch import nn

import threadpar
from benchmarks.harness import machine_line, table
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer

WIDTH, LAYERS, BATCH, STEPS = 2048, 8, 16, 2
CONFIGS = {"DDP + AdamW": 0, "ZeRO-1": 1, "ZeRO-2": 2}
MIB = 2**20


def build() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def train_rank(stage: int, bucket_cap_mb: float) -> None:
    module = build()
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    optimizer: torch.optim.Optimizer
    if stage:
        optimizer = ZeroRedundancyOptimizer(module.parameters(), torch.optim.AdamW, stage=stage, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    generator = threadpar.get_generator()
    for _ in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def child(stage: int, ranks: int, bucket_cap_mb: float) -> None:
    torch.manual_seed(0)
    threadpar.launch(train_rank, stage, bucket_cap_mb, world_size=ranks, devices="cpu")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB


ALLOCATORS = {"glibc default": {}, "mmap threshold 1 MiB": {"MALLOC_MMAP_THRESHOLD_": str(2**20)}}


def measure(stage: int, ranks: int, bucket_cap_mb: float, allocator: str) -> int:
    """The peak RSS in bytes of a fresh process that trains with `stage` (0: plain AdamW)."""
    command = [sys.executable, "-m", "benchmarks.zero_memory", "--child", str(stage), "--ranks", str(ranks)]
    out = subprocess.run(
        [*command, "--bucket-cap-mb", str(bucket_cap_mb)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **ALLOCATORS[allocator]},
    )
    return int(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the configurations")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (its default)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.ranks, args.bucket_cap_mb)
        return
    grad_bytes = sum(p.numel() * p.element_size() for p in build().parameters())  # one rank's gradients
    print(
        f"# ZeRO memory: {args.ranks} rank threads ({machine_line()}); load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"# MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), AdamW, {STEPS} steps of batch {BATCH}, DDP bucket_cap_mb="
        f"{args.bucket_cap_mb:g}; "
        f"{grad_bytes / MIB:.0f} MiB of fp32 gradients per rank; peak RSS of a fresh process, "
        f"median of {args.rounds} rounds\n"
    )
    peaks: dict[tuple[str, str], list[int]] = {(a, n): [] for a in ALLOCATORS for n in CONFIGS}
    for _ in range(args.rounds):
        for allocator in ALLOCATORS:
            for name, stage in CONFIGS.items():
                peaks[allocator, name].append(measure(stage, args.ranks, args.bucket_cap_mb, allocator))
    for allocator in ALLOCATORS:
        report(allocator, {name: peaks[allocator, name] for name in CONFIGS}, args.ranks, grad_bytes)


def report(allocator: str, peaks: dict[str, list[int]], ranks: int, grad_bytes: int) -> None:
    median = {name: statistics.median(values) for name, values in peaks.items()}
    ddp = median["DDP + AdamW"]
    rows = [
        [
            name,
            f"{median[name] / MIB:.0f} MiB",
            f"{min(peaks[name]) / MIB:.0f} .. {max(peaks[name]) / MIB:.0f} MiB",
            f"{(ddp - median[name]) / ranks / MIB:+.0f} MiB",
            f"{median[name] / ddp:.3f}",
        ]
        for name in CONFIGS
    ]
    print(f"## malloc: {allocator}\n")
    print(table(["configuration", "peak RSS", "range", "saved vs DDP / rank", "vs DDP"], rows))
    saved = (median["ZeRO-1"] - median["ZeRO-2"]) / ranks
    print(
        f"\nGoals: ZeRO-2 below ZeRO-1 by >= 1/3 of one rank's gradients ({grad_bytes / 3 / MIB:.0f} MiB) per "
        f"rank: {saved / MIB:+.0f} MiB ({saved / grad_bytes:.2f} of the gradients) "
        f"{'met' if saved >= grad_bytes / 3 else 'NOT met'}; ZeRO-1 below DDP: "
        f"{(ddp - median['ZeRO-1']) / ranks / MIB:+.0f} MiB per rank "
        f"{'met' if median['ZeRO-1'] < ddp else 'NOT met'}\n"
    )


if __name__ == "__main__":
    main()
