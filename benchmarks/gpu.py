"""On a GPU node: threadpar's nccl backend (one process, a rank thread per GPU) vs torch.distributed with NCCL
under torchrun (one process per GPU), side by side on the same GPUs, one after the other.

    python -m benchmarks.gpu              # every visible GPU: all-reduce 1/16/64/256 MiB, DDP GPT step, demo
    python -m benchmarks.gpu --quick      # fewer sizes, repeats and demo steps
    python -m benchmarks.gpu --cpu        # smoke run of this script on CPU (threads backend vs gloo)

Rows: all-reduce bus bandwidth by size (nccl-tests' busbw: algbw x 2(n-1)/n), the tokens/s of a DDP training
step of a 12-layer GPT (threadpar.parallel.DistributedDataParallel vs torch's DDP), and the demo's tokens/s
(`python -m threadpar.demo --gpus N` in one process vs `torchrun --nproc-per-node=N -m threadpar.demo --gpus 1`,
the same layout as N processes). ratio = threadpar / torch: above 1, threadpar is faster. Each cell is the
median of repeated timings. Every demo run passes --check (its losses against the single-thread model); a
mismatch fails the benchmark. A second table runs the demo in one process with DDP, ZeRO-1 and ZeRO-2
(--zero 0/1/2) and reports the caching allocator's peak per rank (torch.cuda.max_memory_allocated, the
demo's metrics.json) side by side. Without GPUs it says so and exits 0 (there is nothing to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import threadpar
from benchmarks.gpu_work import (
    ALL_REDUCE_SIZES,
    GPU_GPT,
    MIB,
    SMOKE_GPT,
    GptShape,
    all_reduce_bus_factor,
    all_reduce_times,
    ddp_gpt_step_time,
)
from benchmarks.harness import fmt_bytes, machine_line, table
from threadpar.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]


def threadpar_side(sizes: list[int], gpt: GptShape, repeats: int, steps: int, cpu: bool) -> dict:
    def body() -> dict:
        api, device, rank = threadpar, threadpar.get_device(), threadpar.get_rank()
        return {
            "all_reduce": all_reduce_times(api, device, threadpar.get_world_size(), sizes, repeats),
            "ddp_step": ddp_gpt_step_time(DistributedDataParallel, api, gpt, rank, device, steps, repeats),
        }

    options: dict[str, Any] = {"devices": "cpu", "backend": "threads"} if cpu else {"backend": "nccl"}
    return threadpar.launch(body, world_size=world_size(cpu), **options)[0]


def world_size(cpu: bool) -> int:
    return 2 if cpu else torch.cuda.device_count()


def torchrun(n: int, module_args: list[str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.run([*command, *module_args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"torchrun {' '.join(module_args)} failed:\n{proc.stderr[-3000:]}")


def torch_side(sizes: list[int], gpt: GptShape, repeats: int, steps: int, cpu: bool, tmp: Path) -> dict:
    out = tmp / "torch.json"
    args = [
        "-m",
        "benchmarks.gpu_torchrun",
        "--out",
        str(out),
        "--repeats",
        str(repeats),
        "--steps",
        str(steps),
    ]
    args += ["--gpt", gpt.as_arg(), "--sizes", *map(str, sizes), *(["--cpu"] if cpu else [])]
    torchrun(world_size(cpu), args)
    return json.loads(out.read_text())


def demo_flags(steps: int) -> list[str]:
    return ["--steps", str(steps), "--model", "small", "--log-every", str(steps), "--check"]


def demo_metrics(path: Path) -> dict:
    """The demo's metrics.json; its --check must have matched the single-thread model."""
    metrics = json.loads((path / "metrics.json").read_text())
    check = metrics.get("check")
    if not check or not check["ok"]:
        raise SystemExit(
            f"benchmarks.gpu: the demo in {path} does not match the single-thread model: {check}"
        )
    return metrics


def run_demo(n: int, flags: list[str], out: Path) -> dict:
    """`python -m threadpar.demo --gpus n` in one process (n rank threads); its checked metrics."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "threadpar.demo", "--gpus", str(n), *flags, "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return demo_metrics(out)


def demo_tokens_per_s(n: int, steps: int, cpu: bool, tmp: Path) -> tuple[float, float]:
    """The demo's own tokens/s (metrics.json): one process with n rank threads, then n torchrun processes."""
    flags = demo_flags(steps)
    one = run_demo(n, flags, tmp / "demo_threadpar")
    many = tmp / "demo_torchrun"
    torchrun(n, ["-m", "threadpar.demo", "--gpus", "1", *flags, "--out", str(many)])
    return one["tokens_per_s"], demo_metrics(many)["tokens_per_s"]


ZERO_STAGES = {"DDP": "0", "ZeRO-1": "1", "ZeRO-2": "2"}


def zero_peaks(n: int, steps: int, cpu: bool, tmp: Path) -> dict[str, int | None]:
    """The demo on n data-parallel ranks with --zero 0/1/2: the largest per-rank allocator peak of each
    (None on CPU, where there is no caching allocator to ask)."""
    peaks: dict[str, int | None] = {}
    for name, stage in ZERO_STAGES.items():
        layout = ["--dp", str(n), "--tp", "1", "--pp", "1"]  # ZeRO shards over data parallelism only
        metrics = run_demo(n, [*demo_flags(steps), *layout, "--zero", stage], tmp / f"demo_zero{stage}")
        values = [p.get("device_allocated_bytes") for p in metrics["peak_memory"].values()]
        peaks[name] = max(values) if all(v is not None for v in values) and values else None
    return peaks


def zero_rows(peaks: dict[str, int | None]) -> list[list[str]]:
    ddp = peaks["DDP"]
    return [
        [
            f"demo --zero {ZERO_STAGES[name]} ({name})",
            "n/a (CPU)" if peak is None else fmt_bytes(peak),
            "-" if peak is None or not ddp else f"{peak / ddp:.3f}",
        ]
        for name, peak in peaks.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 sizes, 3 repeats, a 10-step demo")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu", action="store_true", help="smoke run on CPU: threads backend vs gloo, tiny")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.cpu and gpus < 2:
        why = "no CUDA GPUs are visible" if gpus == 0 else "only 1 GPU is visible (a collective needs 2)"
        print(f"benchmarks.gpu: {why} ({machine_line()}); nothing to compare. Run it on a node with 2+ GPUs.")
        return 0
    gpt = SMOKE_GPT if args.cpu else GPU_GPT
    if args.cpu:
        sizes, repeats, steps, demo_steps = [MIB], 2, 2, 3
    elif args.quick:
        sizes, repeats, steps, demo_steps = [MIB, 64 * MIB], 3, 5, 10
    else:
        sizes, repeats, steps, demo_steps = list(ALL_REDUCE_SIZES), args.repeats, 10, 30
    n = world_size(args.cpu)
    print(f"# GPU benchmark: threadpar nccl backend (1 process) vs torch.distributed NCCL (torchrun, 1 process "
          f"per GPU) on {n} {'CPU ranks (--cpu smoke run: threads vs gloo)' if args.cpu else 'GPUs'}; {machine_line()}")  # fmt: skip
    print(
        f"# median of {repeats} repeats per cell; ratio = threadpar / torch (> 1: threadpar faster)\n",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ours = threadpar_side(sizes, gpt, repeats, steps, args.cpu)
        theirs = torch_side(sizes, gpt, repeats, steps, args.cpu, Path(tmp))
        demo = demo_tokens_per_s(n, demo_steps, args.cpu, Path(tmp))
        peaks = zero_peaks(n, demo_steps, args.cpu, Path(tmp))
    print(
        table(["measure", "threadpar", "torch.distributed", "ratio"], rows(ours, theirs, demo, sizes, gpt, n))
    )
    print("\n# allocator peak per rank (the largest rank), demo --model small, every demo run --check'ed\n")
    print(table(["configuration", "peak allocated / rank", "vs DDP"], zero_rows(peaks)))
    return 0


def rows(
    ours: dict, theirs: dict, demo: tuple[float, float], sizes: list[int], gpt: GptShape, n: int
) -> list[list[str]]:
    out = []
    for nbytes in sizes:
        bus = lambda seconds: nbytes / seconds / 1e9 * all_reduce_bus_factor(n)  # noqa: B023, E731
        a, b = bus(ours["all_reduce"][str(nbytes)]), bus(theirs["all_reduce"][str(nbytes)])
        out.append([f"all_reduce {fmt_bytes(nbytes)}: busbw GB/s", f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x"])
    a, b = gpt.tokens_per_step(n) / ours["ddp_step"], gpt.tokens_per_step(n) / theirs["ddp_step"]
    out.append([f"DDP GPT step ({gpt.size}): tokens/s", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.2f}x"])
    out.append(
        ["demo (--model small): tokens/s", f"{demo[0]:,.0f}", f"{demo[1]:,.0f}", f"{demo[0] / demo[1]:.2f}x"]
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
