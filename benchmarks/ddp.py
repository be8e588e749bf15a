"""DistributedDataParallel: threadpar on rank threads vs torch DDP over gloo vs one process on the same batch.

    python -m benchmarks.ddp            # full run (about 3 minutes on 2 cores)
    python -m benchmarks.ddp --quick    # 2 rounds, fewer steps

Model: an MLP of 4 Linear(1024, 1024) layers (16 MiB of float32 gradients), MSE loss, SGD. One step is
zero_grad, forward, backward (with gradient synchronization) and optimizer.step(). 2 ranks with batch 64
each; the single process runs batch 128 with all cores. Ratios: throughput vs torch DDP over gloo (higher is
better) and step time vs the single process (lower is better).

Each configuration is timed twice in the same loop: wall-clock step time (what the issue's targets are
about), and CPU time per step summed over every thread of every rank (process CPU time; both processes for
gloo). On a machine shared with other work, wall-clock time measures the cores we were given as much as the
code, while CPU time barely moves with the load: 2 cores / CPU time per step is the throughput the
configuration would have on the 2 cores alone (spinning threads count as busy: OpenMP's in the one process,
so its CPU time is not comparable).

The table also compares ways of averaging the same gradients on threadpar (bucketed DDP, one all-reduce per
gradient, all gradients after backward, nothing at all), and a timeline shows when each bucket's all-reduce
ran relative to the end of backward.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_time, machine_line, run_gloo, table
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.ddp import comm_hooks

WIDTH, LAYERS, BATCH, RANKS = 1024, 4, 64, 2

# name -> how threadpar averages gradients; DDP keyword arguments where it uses DDP.
THREADPAR_CONFIGS = {
    "DDP (defaults: buckets 1 + 25 MiB)": ("ddp", {}),
    "DDP, 4 MiB buckets (one per layer)": ("ddp", {"bucket_cap_mb": 4}),
    "DDP, one bucket (no overlap)": ("ddp", {"bucket_cap_mb": 1024, "first_bucket_cap_mb": 1024}),
    "DDP, bucketing off (one all-reduce per parameter)": ("ddp", {"gradient_bucketing": False}),
    "DDP, 4 MiB buckets, grads as bucket views": (
        "ddp",
        {"bucket_cap_mb": 4, "gradient_as_bucket_view": True},
    ),
    "no DDP: all-reduce each gradient after backward": ("after_each", {}),
    "no DDP: one coalesced all-reduce after backward": ("after_coalesced", {}),
    "no communication (compute only, lower bound)": ("none", {}),
}
DEFAULT = "DDP (defaults: buckets 1 + 25 MiB)"
HEADLINE = "DDP, 4 MiB buckets (one per layer)"  # the timeline's configuration


def build_mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_step(model: nn.Module, trained: nn.Module, batch: int, generator: torch.Generator | None, sync=None):
    """One training step of `model` (`trained` is what the optimizer updates: the module inside DDP)."""
    optimizer = torch.optim.SGD(trained.parameters(), lr=1e-3)
    x = torch.randn(batch, WIDTH, generator=generator)
    y = torch.randn(batch, WIDTH, generator=generator)

    def step() -> None:
        optimizer.zero_grad()  # set_to_none=True, torch's default: autograd's gradient tensors are kept
        nn.functional.mse_loss(model(x), y).backward()
        if sync is not None:
            sync()
        optimizer.step()

    return step


def wall_and_cpu(step, iters: int, repeats: int, sync=None) -> tuple[float, float]:
    """Medians over `repeats` of the wall-clock and process CPU seconds per call of `step`."""
    walls, cpus = [], []
    for _ in range(repeats):
        if sync is not None:
            sync()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            step()
        walls.append((time.perf_counter() - wall) / iters)
        cpus.append((time.process_time() - cpu) / iters)
    return statistics.median(walls), statistics.median(cpus)


def threadpar_rank(
    template: nn.Module, mode: str, ddp_kwargs: dict, iters: int, repeats: int
) -> tuple[float, float]:
    module = copy.deepcopy(template)
    model, sync = module, None
    grads = lambda: [p.grad for p in module.parameters()]  # noqa: E731
    if mode == "ddp":
        model = DistributedDataParallel(module, **ddp_kwargs)
    elif mode == "after_each":
        sync = lambda: [threadpar.all_reduce(g, op="AVG") for g in grads()]  # noqa: E731
    elif mode == "after_coalesced":
        sync = lambda: threadpar.all_reduce_coalesced(grads(), op="AVG")  # noqa: E731
    step = make_step(model, module, BATCH, threadpar.get_generator(), sync)
    for _ in range(3):
        step()  # warm-up (and DDP's bucket rebuild)
    # All ranks are threads of this process: its CPU time covers every rank and comm worker.
    return wall_and_cpu(step, iters, repeats, sync=threadpar.barrier)


def gloo_rank(rank: int, world: int, iters: int, repeats: int) -> tuple[float, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    module = build_mlp()
    step = make_step(TorchDDP(module), module, BATCH, torch.Generator().manual_seed(rank))
    for _ in range(3):
        step()
    wall, cpu = wall_and_cpu(step, iters, repeats, sync=dist.barrier)
    total = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(total)  # the CPU time of both processes
    return wall, total.item()


def timeline_rank(template: nn.Module, ddp_kwargs: dict, steps: int) -> list[list[float]]:
    """Per step: [backward end, then for each bucket: launched, done], in ms after backward starts."""
    module = copy.deepcopy(template)
    ddp = DistributedDataParallel(module, **ddp_kwargs)
    marks: dict[str, float] = {}

    def timed_hook(group, bucket):
        k = bucket.index()
        marks[f"launch{k}"] = time.perf_counter()
        future = comm_hooks.allreduce_hook(group, bucket)
        future.add_done_callback(lambda _: marks.__setitem__(f"done{k}", time.perf_counter()))
        return future

    ddp.register_comm_hook(None, timed_hook)
    x = torch.randn(BATCH, WIDTH, generator=threadpar.get_generator())
    rows = []
    for step in range(steps + 3):
        module.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), x)
        threadpar.barrier()
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        if step >= 3:  # after warm-up and the rebuild
            n = len(ddp.reducer.bucket_indices())
            times = [end] + [marks[f"{what}{k}"] for k in range(n) for what in ("launch", "done")]
            rows.append([(t - start) * 1e3 for t in times])
    return rows


def print_timeline(template: nn.Module, ddp_kwargs: dict, steps: int) -> None:
    rows = threadpar.launch(
        timeline_rank, template, ddp_kwargs, steps, world_size=RANKS, devices="cpu", rank_cores=EVERY_CORE
    )[0]
    median = [statistics.median(col) for col in zip(*rows)]
    end, buckets = median[0], median[1:]
    print(f"\n## When the bucket all-reduces ran ({HEADLINE}; rank 0, median of {steps} steps)\n")
    print(f"backward took {end:.1f} ms; times in ms from the start of backward\n")
    lines = []
    for k in range(len(buckets) // 2):
        launched, done = buckets[2 * k], buckets[2 * k + 1]
        lines.append([k, f"{launched:.1f}", f"{done:.1f}", f"{max(0.0, min(done, end) - launched):.1f}"])
    print(table(["bucket", "launched", "done", "ms of it inside backward"], lines))


def measure_round(template: nn.Module, iters: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Every configuration once, one after the other (rounds interleave them, so noise hits all alike)."""
    single_step = make_step(template, template, RANKS * BATCH, torch.Generator().manual_seed(0))
    for _ in range(3):
        single_step()
    times = {"single": wall_and_cpu(single_step, iters, repeats)}
    times["gloo"] = tuple(run_gloo(gloo_rank, RANKS, iters, repeats))
    for name, (mode, kwargs) in THREADPAR_CONFIGS.items():
        times[name] = threadpar.launch(
            threadpar_rank,
            template,
            mode,
            kwargs,
            iters,
            repeats,
            world_size=RANKS,
            devices="cpu",
            rank_cores=EVERY_CORE,
        )[0]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over all configurations")
    parser.add_argument("--iters", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per configuration and round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 repeats of 5 steps")
    args = parser.parse_args()
    rounds, iters, repeats = (2, 5, 3) if args.quick else (args.rounds, args.iters, args.repeats)
    torch.manual_seed(0)
    template = build_mlp()
    cores = len(os.sched_getaffinity(0))
    print(f"# DDP: MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), {RANKS} ranks x batch {BATCH} ({machine_line()})")
    print(
        f"# median over {rounds} interleaved rounds of the median of {repeats} repeats of the mean of {iters} "
        f"steps (rank 0); load average at start {os.getloadavg()[0]:.1f}\n"
    )
    per_round = [measure_round(template, iters, repeats) for _ in range(rounds)]
    wall = {name: statistics.median(r[name][0] for r in per_round) for name in per_round[0]}
    cpu = {name: statistics.median(r[name][1] for r in per_round) for name in per_round[0]}
    samples = RANKS * BATCH
    labels = {
        "single": f"one process, batch {samples}, {torch.get_num_threads()} threads",
        "gloo": f"torch DDP over gloo, {RANKS} processes",
    } | {name: f"threadpar {name}" for name in THREADPAR_CONFIGS}
    rows = []
    for key, label in labels.items():
        low, high = min(r[key][0] for r in per_round), max(r[key][0] for r in per_round)
        rows.append(
            [
                label,
                fmt_time(wall[key]),
                f"{fmt_time(low)} .. {fmt_time(high)}",
                f"{samples / wall[key]:.0f}",
                "" if key == "single" else f"{wall['gloo'] / wall[key]:.2f}x",
                f"{wall[key] / wall['single']:.2f}x",
                fmt_time(cpu[key]),
                "" if key == "single" else f"{cpu['gloo'] / cpu[key]:.2f}x",
            ]
        )
    headers = ["configuration", "step", "range over rounds", "samples/s", "throughput vs gloo DDP"]
    headers += ["step vs one process", "CPU time/step", "vs gloo DDP, by CPU time"]
    print(table(headers, rows))
    print(
        f"\nBy CPU time: the ratio of CPU time per step, i.e. of throughput on {cores} cores used by nothing "
        "else. Not shown against the one process: its OpenMP threads spin while they wait for each other, "
        "which under load burns CPU time that is not work."
    )

    ddp = [name for name in THREADPAR_CONFIGS if name.startswith("DDP")]
    best = min(ddp, key=lambda name: wall[name])
    compute = wall["no communication (compute only, lower bound)"]
    print(
        f"\nTargets (wall clock): throughput >= 2.2x torch DDP over gloo: {wall['gloo'] / wall[DEFAULT]:.2f}x "
        f"with the defaults, {wall['gloo'] / wall[best]:.2f}x with '{best}' (and at most "
        f"{wall['gloo'] / compute:.2f}x without any communication); step <= 1.35x one process: "
        f"{wall[DEFAULT] / wall['single']:.2f}x with the defaults, {wall[best] / wall['single']:.2f}x with '{best}'."
    )
    after = wall["no DDP: one coalesced all-reduce after backward"]
    print(
        f"Synchronizing costs {fmt_time(after - compute)} per step as one all-reduce after backward, "
        f"{fmt_time(wall[HEADLINE] - compute)} with '{HEADLINE}' overlapping backward "
        f"(compute-only step {fmt_time(compute)})."
    )
    print_timeline(template, THREADPAR_CONFIGS[HEADLINE][1], steps=max(5, iters))
    print(f"\n# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
