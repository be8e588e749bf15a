"""Collectives: threadpar's `threads` backend vs torch.distributed over gloo (one process per rank).

    python -m benchmarks.collectives            # full table, 2 and 4 ranks
    python -m benchmarks.collectives --quick    # fewer repeats

Bandwidths as nccl-tests reports them: algbw = bytes / time, where bytes is the all-reduce/broadcast
buffer, the all-gather output and the reduce-scatter input; busbw = algbw x 2(n-1)/n for all-reduce,
x (n-1)/n for all-gather and reduce-scatter, x 1 for broadcast. Ratios > 1 mean threadpar is faster.
"""

from __future__ import annotations

import argparse

import torch

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_bytes, fmt_time, machine_line, median_time, run_gloo, table

KIB, MIB = 1 << 10, 1 << 20
CASES = [("all_reduce", n) for n in (4, KIB, MIB, 16 * MIB, 64 * MIB)] + [
    ("all_gather", 16 * MIB),
    ("reduce_scatter", 16 * MIB),
    ("broadcast", 16 * MIB),
]


def iters_for(nbytes: int) -> int:
    return 200 if nbytes <= 64 * KIB else 20 if nbytes <= MIB else 5 if nbytes <= 16 * MIB else 2


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(
        op, 1.0
    )


def make_op(api, op: str, nbytes: int, n: int, group=None):
    """A no-argument closure running one collective through `api` (threadpar or torch.distributed)."""
    numel = max(1, nbytes // 4)
    if op == "all_reduce":
        t = torch.ones(numel)
        return lambda: api.all_reduce(t, group=group)
    if op == "broadcast":
        t = torch.ones(numel)
        return lambda: api.broadcast(t, src=0, group=group)
    if op == "all_gather":  # nbytes is the gathered output
        out, inp = torch.empty(numel), torch.ones(numel // n)
        return lambda: api.all_gather_into_tensor(out, inp, group=group)
    inp, out = torch.ones(numel), torch.empty(numel // n)  # reduce_scatter: nbytes is the input
    return lambda: api.reduce_scatter_tensor(out, inp, group=group)


def measure_all(api, n: int, repeats: int, barrier) -> dict[str, float]:
    results = {}
    for op, nbytes in CASES:
        fn = make_op(api, op, nbytes, n)
        for _ in range(2):
            fn()  # warm-up
        results[f"{op}:{nbytes}"] = median_time(fn, iters=iters_for(nbytes), repeats=repeats, sync=barrier)
    return results


def gloo_worker(rank: int, n: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    return measure_all(dist, n, repeats, dist.barrier)


def threads_worker(n: int, repeats: int) -> dict[str, float]:
    return measure_all(threadpar, n, repeats, threadpar.barrier)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    print(f"# collectives: threadpar threads backend vs gloo, one process per rank ({machine_line()})")
    print(f"# median of {repeats} repeats per cell\n")
    rows = []
    for n in args.ranks:
        ours = threadpar.launch(
            threads_worker, n, repeats, world_size=n, devices="cpu", rank_cores=EVERY_CORE
        )[0]
        gloo = run_gloo(gloo_worker, n, repeats)
        for op, nbytes in CASES:
            key = f"{op}:{nbytes}"
            t_ours, t_gloo = ours[key], gloo[key]
            bus = lambda t: nbytes / t * bus_factor(op, n) / 1e9  # noqa: B023, E731
            times = [fmt_time(t_ours), fmt_time(t_gloo)]
            bandwidths = [f"{bus(t_ours):.2f}", f"{bus(t_gloo):.2f}"]
            rows.append([op, n, fmt_bytes(nbytes), *times, *bandwidths, f"{t_gloo / t_ours:.1f}x"])
    headers = ["op", "ranks", "size", "threadpar", "gloo", "busbw GB/s (tp)", "busbw GB/s (gloo)", "speed-up"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
