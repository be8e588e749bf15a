"""Ranks sharing one device (issue 29): k rank threads on one GPU (or k CPU threads) against one rank.

    python -m benchmarks.shared_gpu                  # k = 2, 4, 8; GPT-2 small's shape on a GPU
    python -m benchmarks.shared_gpu --quick          # a tiny GPT, 3 repeats (the smoke test's run)
    python -m benchmarks.shared_gpu --ranks 8 --json out.json
    python -m benchmarks.shared_gpu --memory         # CUDA only: the allocator's peak, DDP vs ZeRO-1/2

Every rank trains the same GPT (on a GPU GPT-2 small's shape, 12 x 768, 1 x 128 tokens per rank) with the
same per-rank batch under threadpar's DDP over the threads backend: on a GPU with devices=[0] * k, on the CPU
with devices="cpu" (where "sharing" is k threads on one core: rank_cores=1, one intra-op thread, for the one
rank too). The anchor is the same k rank steps run one after another on one thread: one rank stepping k
replicas of the model in turn, each with its own DDP. Reported, as medians over repeats of `--iters` steps:
the k-rank step time, each rank thread's CPU time per step (time.thread_time inside the rank), and the ratio
of the k-rank step to the k sequential steps (below 1.0: sharing beats taking turns).

`--memory` (CUDA only): torch.cuda.max_memory_allocated on the one GPU, the caching allocator's device-wide
peak, for k ranks under DDP, ZeRO-1 and ZeRO-2 of the same model with AdamW (k = the largest of --ranks).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from benchmarks.harness import fmt_bytes, fmt_time, machine_line, repeats_of, repeats_parser, table
from threadpar.models.config import GPTConfig
from threadpar.models.gpt import GPT
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer

# (model, tokens per rank): GPT-2 small's shape on a GPU; smaller on the CPU and with --quick.
SHAPES = {
    "gpt2": (GPTConfig(vocab_size=50257, block_size=128, n_layer=12, n_head=12, n_embd=768), 128),
    "small": (GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=128), 64),
    "tiny": (GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64), 32),
}


def default_shape(cuda: bool, quick: bool) -> str:
    if cuda:
        return "small" if quick else "gpt2"
    return "tiny" if quick else "small"


def placement(k: int, cuda: bool) -> dict[str, Any]:
    """launch's options for k ranks on the one device."""
    if cuda:
        return {"world_size": k, "devices": [0] * k, "backend": "threads"}
    # CPU: k threads sharing one core, as ranks share one GPU; the one rank gets the same core.
    return {"world_size": k, "devices": "cpu", "rank_cores": 1, "intraop_threads": 1}


def make_step(template: nn.Module, tokens: int, optimizer: str = "sgd", stage: int = 0) -> Callable[[], None]:
    """One training step of a fresh replica of `template` on this rank: zero_grad, forward, backward (DDP's
    all-reduces inside it), optimizer step."""
    device = threadpar.get_device()
    module = copy.deepcopy(template).to(device)
    ddp = DistributedDataParallel(module)
    params = list(module.parameters())
    opt: torch.optim.Optimizer
    if stage:
        opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, stage=stage, lr=1e-4)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-4)
    vocab = module.config.vocab_size
    g = threadpar.get_generator()
    idx = torch.randint(vocab, (1, tokens), generator=g, device=g.device).to(device)
    targets = torch.randint(vocab, (1, tokens), generator=g, device=g.device).to(device)

    def step() -> None:
        opt.zero_grad()
        logits = ddp(idx)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()

    return step


def timed(step: Callable[[], None], iters: int, repeats: int) -> tuple[float, float]:
    """In a rank: medians over `repeats` of (wall seconds, this thread's CPU seconds) per call of `step`."""
    cuda = threadpar.get_device().type == "cuda"
    for _ in range(2):
        step()  # warm-up: DDP's bucket rebuild, the allocator's first blocks
    walls, cpus = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        threadpar.barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()  # the GPU's work is part of the step (device-wide: every sharing rank's)
        cpus.append((time.thread_time() - cpu) / iters)
        threadpar.barrier()  # the slowest rank ends the step for everybody
        walls.append((time.perf_counter() - wall) / iters)
    return statistics.median(walls), statistics.median(cpus)


def shared_rank(template: nn.Module, tokens: int, iters: int, repeats: int) -> tuple[float, float]:
    return timed(make_step(template, tokens), iters, repeats)


def sequential_rank(
    template: nn.Module, tokens: int, k: int, iters: int, repeats: int
) -> tuple[float, float]:
    """The anchor: one rank steps k replicas in turn (k one-rank steps, one after another, on one thread)."""
    steps = [make_step(template, tokens) for _ in range(k)]

    def round_of_k() -> None:
        for step in steps:
            step()

    return timed(round_of_k, iters, repeats)


def measure(template: nn.Module, tokens: int, ks: list[int], cuda: bool, iters: int, repeats: int) -> dict:
    results: dict[str, Any] = {"ranks": {}}
    for k in ks:
        (seq_wall, seq_cpu), *_ = threadpar.launch(
            sequential_rank, template, tokens, k, iters, repeats, **placement(1, cuda)
        )
        per_rank = threadpar.launch(shared_rank, template, tokens, iters, repeats, **placement(k, cuda))
        step = max(wall for wall, _ in per_rank)
        cpus = [cpu for _, cpu in per_rank]
        results["ranks"][k] = {
            "step_s": step,
            "sequential_s": seq_wall,
            "ratio": step / seq_wall,
            "one_rank_step_s": seq_wall / k,
            "one_rank_cpu_s": seq_cpu / k,
            "rank_cpu_s": cpus,
        }
    return results


def memory_rank(template: nn.Module, tokens: int, stage: int) -> None:
    step = make_step(template, tokens, optimizer="adamw", stage=stage)
    for _ in range(3):
        step()
    torch.cuda.synchronize()


def measure_memory(template: nn.Module, tokens: int, k: int) -> dict[str, int]:
    """The allocator's device-wide peak on GPU 0 for k ranks under DDP (AdamW), ZeRO-1 and ZeRO-2."""
    peaks = {}
    torch.cuda.init()  # the allocator's statistics exist once CUDA is initialised on this thread
    for name, stage in (("DDP", 0), ("ZeRO-1", 1), ("ZeRO-2", 2)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        threadpar.launch(memory_rank, template, tokens, stage, **placement(k, True))
        peaks[name] = torch.cuda.max_memory_allocated(0)
    return peaks


def report(results: dict) -> None:
    rows = []
    for k, r in results["ranks"].items():
        cpus = r["rank_cpu_s"]
        rows.append(
            [
                k,
                fmt_time(r["one_rank_step_s"]),
                fmt_time(r["sequential_s"]),
                fmt_time(r["step_s"]),
                f"{fmt_time(sum(cpus))} / {fmt_time(max(cpus))}",
                f"{max(cpus) / r['one_rank_cpu_s']:.2f}x",
                f"{r['ratio']:.2f}x",
            ]
        )
    headers = [
        "ranks k",
        "one rank step",
        "k steps in turn",
        "k ranks sharing: step",
        "rank threads' CPU/step (sum / largest)",
        "largest rank CPU vs one rank",
        "ratio (sharing / in turn)",
    ]
    print(table(headers, rows))
    for k, r in results["ranks"].items():
        print(f"ratio k={k}: {r['ratio']:.2f}x the time of {k} one-rank steps run one after another")


def main(argv: list[str] | None = None) -> int:
    parser = repeats_parser(__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="the k's (default: 2 4 8)")
    parser.add_argument(
        "--iters", type=int, default=None, help="steps per repeat (default 5; 2 with --quick)"
    )
    parser.add_argument("--model", choices=sorted(SHAPES), help="default: gpt2 on a GPU, small on the CPU")
    parser.add_argument("--memory", action="store_true", help="CUDA only: peak memory, DDP vs ZeRO-1/2")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.ranks):
        parser.error(f"--ranks {args.ranks}: every k must be at least 1")
    cuda = torch.cuda.is_available()
    if args.memory and not cuda:
        print(
            "--memory needs CUDA: it reads the caching allocator's peak on one GPU (no GPU is visible here)"
        )
        return 2
    shape = args.model or default_shape(cuda, args.quick)
    config, tokens = SHAPES[shape]
    iters = args.iters or (2 if args.quick else 5)
    repeats = repeats_of(args)
    template = GPT(config)  # built once, on this thread (its initialisation draws from the default generator)
    where = "one GPU (cuda:0)" if cuda else "the CPU (k threads on one core)"
    print(f"{machine_line()}; k ranks on {where}; model {shape} ({config.n_layer} x {config.n_embd}, "
          f"1 x {tokens} tokens per rank), threadpar DDP over the threads backend")  # fmt: skip
    results: dict[str, Any] = {"device": "cuda" if cuda else "cpu", "model": shape, "tokens": tokens}
    if args.memory:
        k = max(args.ranks)
        results["memory_peak_bytes"] = peaks = measure_memory(template, tokens, k)
        print(
            table(
                [f"{k} ranks on cuda:0", "max_memory_allocated"],
                [[n, fmt_bytes(b)] for n, b in peaks.items()],
            )
        )
    else:
        results.update(measure(template, tokens, sorted(set(args.ranks)), cuda, iters, repeats))
        report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
