"""torch's own DDP and FSDP2 training steps on three torch.distributed backends, side by side in one run.

    python -m benchmarks.torch_dist            # 3 rounds x 5 repeats x 5 steps per cell
    python -m benchmarks.torch_dist --quick    # 1 round x 3 repeats

The same function (torch.distributed API only: DistributedDataParallel, fully_shard) runs on 2 ranks as
- threadpar: 2 rank threads of one process, torch.distributed on the `threadpar` c10d backend, twice: with
  the rank threads packed on one core (the default for CPU ranks: DESIGN.md rule 9) and with
  `rank_cores="all"` (every core, as the other two run);
- threaded: torch's own threaded process group (torch.testing._internal.distributed.multi_threaded_pg),
  2 threads of one process, as torch's tests run it;
- gloo: one process per rank over gloo (the usual way on CPU).
Model: an MLP of 4 Linear(512, 512) layers (4 MiB of float32 parameters), batch 32 per rank, MSE loss,
SGD. A step is forward, backward (gradient averaging: DDP's all-reduces, or FSDP2's all-gathers and
reduce-scatters) and optimizer.step(). Every rank gets 1 intra-op thread per core / 2 (gloo processes 1).
The four run in alternation, round after round, so a change in the machine's load hits all of them; each
cell is the median of every repeat of every round. speed-up = other backend's step time / threadpar's
(packed, then all cores).
Two clocks: wall-clock step time, and CPU time per step of all ranks together (process CPU time; both
processes summed for gloo), which moves far less than wall-clock time with the load of a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings

import torch
from torch import nn

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_time, machine_line, median_time, run_gloo, table
from threadpar.runtime.launch import available_cores

WIDTH, LAYERS, BATCH, RANKS, STEPS = 512, 4, 32, 2, 5
KINDS = ("DDP", "FSDP2")


def steps(kind: str, repeats: int) -> dict[str, list[float]]:
    """Per training step of `kind`, one sample per repeat, on torch.distributed's current group: "wall"
    seconds, and "cpu" seconds of every rank together (this process's CPU time: all ranks when they are
    threads; summed over the ranks' processes for gloo)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    if kind == "DDP":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, WIDTH, generator=g)

    def step() -> None:
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: buckets, lazy init
    wall, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        start_cpu = time.process_time()
        wall.append(median_time(step, iters=STEPS, repeats=1))
        cpu.append((time.process_time() - start_cpu) / STEPS)
    return {"wall": wall, "cpu": cpu}


def summed_cpu(result: dict[str, list[float]]) -> dict[str, list[float]]:
    """One process per rank: add the other ranks' CPU time to this one's (all ranks call this)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result["cpu"])
    return {"wall": result["wall"], "cpu": [sum(column) for column in zip(*everyone, strict=True)]}


def on_threadpar(repeats: int, rank_cores: str | None = None) -> dict[str, dict[str, list[float]]]:
    results = threadpar.launch(
        lambda: {k: steps(k, repeats) for k in KINDS},
        world_size=RANKS,
        devices="cpu",
        timeout=600,
        rank_cores=rank_cores,
    )
    return results[0]


def on_threadpar_all_cores(repeats: int) -> dict[str, dict[str, list[float]]]:
    return on_threadpar(repeats, rank_cores=EVERY_CORE)


def on_threaded_pg(repeats: int) -> dict[str, dict[str, list[float]]]:
    """torch's threaded process group, set up as torch's MultiThreadedTestCase does."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    hook = sys.excepthook  # init_process_group wraps it, process-wide, in every rank thread
    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    store = dist.HashStore()
    results: list = [None] * RANKS
    threads_each = max(1, available_cores() // RANKS)

    def rank_main(rank: int) -> None:
        torch.set_num_threads(threads_each)
        dist.init_process_group("threaded", rank=rank, world_size=RANKS, store=store)
        try:
            results[rank] = {k: steps(k, repeats) for k in KINDS}
        finally:
            dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(RANKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
        mtpg._uninstall_threaded_pg()
        mtpg.ProcessLocalGroup.reset()
        sys.excepthook = hook
    if results[0] is None:
        raise RuntimeError("a rank of torch's threaded process group failed (see its traceback above)")
    return results[0]


def gloo_worker(rank: int, world_size: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    return {k: summed_cpu(steps(k, repeats)) for k in KINDS}


def on_gloo(repeats: int) -> dict[str, dict[str, list[float]]]:
    return run_gloo(gloo_worker, RANKS, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 round x 3 repeats")
    args = parser.parse_args()
    rounds, repeats = (1, 3) if args.quick else (args.rounds, args.repeats)
    warnings.filterwarnings("ignore", category=FutureWarning)
    runners = {
        "packed": on_threadpar,
        "all cores": on_threadpar_all_cores,
        "threaded": on_threaded_pg,
        "gloo": on_gloo,
    }
    samples = {b: {k: {"wall": [], "cpu": []} for k in KINDS} for b in runners}
    for _ in range(rounds):
        for backend, run in runners.items():
            for kind, times in run(repeats).items():
                for clock in ("wall", "cpu"):
                    samples[backend][kind][clock].extend(times[clock])
    median = {
        b: {k: {c: statistics.median(v) for c, v in clocks.items()} for k, clocks in per.items()}
        for b, per in samples.items()
    }
    print(machine_line())
    print(
        f"{RANKS} ranks, MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank; "
        f"{rounds} round(s) x {repeats} repeats x {STEPS} steps per cell; medians"
    )
    rows = []
    for clock in ("wall", "cpu"):
        for kind in KINDS:
            packed, spread, threaded, gloo = (median[b][kind][clock] for b in runners)
            rows.append(
                [
                    f"{kind} ({'wall-clock' if clock == 'wall' else 'CPU, all ranks'})",
                    *(fmt_time(t) for t in (packed, spread, threaded, gloo)),
                    *(f"{other / ours:.2f}x" for other in (threaded, gloo) for ours in (packed, spread)),
                ]
            )
    headers = [
        "step time",
        "threadpar, packed",
        "threadpar, all cores",
        "torch threaded PG",
        "gloo, process per rank",
        "vs threaded: packed",
        "all cores",
        "vs gloo: packed",
        "all cores",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
