"""One training step on a rank thread against the same step in a plain loop on the main thread: wall time per
step and the calling thread's CPU time per step (time.thread_time), medians over steps. On the first GPU the
rank thread used 2.1x the main thread's CPU time at world 1 (wall 1.09x); on CPU threads the two are equal.

GPT-2 small's shape (12 x 768, 12 heads, 1 x 128 tokens) on a GPU; `--quick` or no GPU: a tiny GPT on CPU.
The rank thread runs the same model, data and optimizer inside threadpar.launch(world_size=1) (on a GPU
the nccl backend: no collective is issued, so the difference is the thread itself: its context, streams,
autograd's device threads off).

    python -m benchmarks.rank_thread_step [--steps 30] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import threadpar
from threadpar.models.config import GPTConfig
from threadpar.models.gpt import GPT

GPT2_SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=128, vocab_size=50304)
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)


def steps(config: GPTConfig, device: torch.device, n: int) -> dict[str, float]:
    """Median wall and thread-CPU milliseconds per step of `n` steps (after 3 warm-up steps)."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, config.vocab_size, (1, config.block_size), device=device)
    walls, cpus = [], []
    for i in range(n + 3):
        wall, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        model.loss(idx, idx).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            walls.append((time.perf_counter() - wall) * 1e3)
            cpus.append((time.thread_time() - cpu) * 1e3)
    return {"wall_ms": statistics.median(walls), "cpu_ms": statistics.median(cpus)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    config = GPT2_SMALL if gpu else TINY
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    results: dict[str, Any] = {"device": str(device), "model": "GPT-2 small shape" if gpu else "tiny GPT"}
    for _ in range(2):  # alternating, twice: the second pair is reported (caches and clocks warm)
        results["main thread"] = steps(config, device, args.steps)
        options = {} if gpu else {"devices": "cpu"}
        results["rank thread"] = threadpar.launch(
            lambda: steps(config, threadpar.get_device(), args.steps), world_size=1, **options
        )[0]
    main_, rank = results["main thread"], results["rank thread"]
    results["wall ratio"] = rank["wall_ms"] / main_["wall_ms"]
    results["cpu ratio"] = rank["cpu_ms"] / main_["cpu_ms"]
    print(f"one training step, {results['model']} on {device}, medians of {args.steps} steps")
    print("| where | wall ms / step | thread CPU ms / step |\n|---|---|---|")
    for name in ("main thread", "rank thread"):
        print(f"| {name} | {results[name]['wall_ms']:.2f} | {results[name]['cpu_ms']:.2f} |")
    print(f"rank thread / main thread: wall {results['wall ratio']:.2f}x, CPU {results['cpu ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
