"""All-reduce over 4 ranks that span processes: 2 processes x 2 rank threads (hierarchical) vs 4 gloo processes.

    python -m benchmarks.multiprocess            # 4 B, 16 and 64 MiB: 3 rounds x 5 repeats per cell
    python -m benchmarks.multiprocess --quick    # 1 round x 3 repeats

Three ways to run 4 ranks, one after the other in one run, on this machine:
- gloo: torch.distributed, one process per rank (the anchor);
- hierarchical: threadpar under 2 processes x threads_per_process=2; each all-reduce is a local
  reduce-scatter between the 2 threads, 2 parallel gloo all-reduces of half the buffer between the
  processes (one per thread), and a local all-gather;
- threads: threadpar in one process with 4 rank threads (shared memory only), for reference.
Every rank owns one core's share (cores / 4 intra-op threads; gloo processes get 1). The three run in
alternation, round after round, so a change in the machine's load hits all of them; each cell is the median
of every repeat of every round. speed-up = gloo time / hierarchical time; the issue's target is >= 1.5x.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_bytes, fmt_time, machine_line, median_time, run_gloo, table
from threadpar.runtime.launch import available_cores

MIB = 1 << 20
SIZES = (4, 16 * MIB, 64 * MIB)  # 4 B: latency (not part of the target)
RANKS = 4


def iters_for(nbytes: int) -> int:
    return 50 if nbytes < MIB else 5 if nbytes <= 16 * MIB else 2


def measure(api, repeats: int, barrier) -> dict[str, list[float]]:
    """Seconds per all-reduce of each size through `api` (threadpar or torch.distributed): one sample
    (a mean over a few calls) per repeat."""
    results = {}
    for nbytes in SIZES:
        t = torch.ones(max(1, nbytes // 4))
        for _ in range(2):
            api.all_reduce(t)  # warm-up: connections, lanes, page faults
        results[str(nbytes)] = [
            median_time(lambda t=t: api.all_reduce(t), iters=iters_for(nbytes), repeats=1, sync=barrier)
            for _ in range(repeats)
        ]
    return results


def gloo_worker(rank: int, world_size: int, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    return measure(dist, repeats, dist.barrier)


def threadpar_ranks(repeats: int) -> dict[str, list[float]]:
    return measure(threadpar, repeats, threadpar.barrier)


def hierarchical_worker(rank: int, world_size: int, repeats: int, intraop: int) -> dict[str, list[float]]:
    # run_gloo initialised torch.distributed's default group: launch finds it and spans both processes.
    results = threadpar.launch(
        threadpar_ranks,
        repeats,
        threads_per_process=RANKS // world_size,
        intraop_threads=intraop,
        rank_cores=EVERY_CORE,
    )
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="samples per cell and round")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 repeats")
    args = parser.parse_args()
    rounds, repeats = (1, 3) if args.quick else (args.rounds, args.repeats)
    intraop = max(1, available_cores() // RANKS)
    print(
        f"# all-reduce over {RANKS} ranks spanning processes ({machine_line()}; {intraop} intra-op thread(s) per rank)"
    )
    print(f"# median of {rounds} rounds x {repeats} repeats per cell; busbw = bytes / time x 2(n-1)/n")
    load_before = os.getloadavg()[0]
    samples: dict[str, dict[str, list[float]]] = {"gloo": {}, "hier": {}, "threads": {}}
    for _ in range(rounds):
        runs = {
            "gloo": run_gloo(gloo_worker, RANKS, repeats),
            "hier": run_gloo(hierarchical_worker, 2, repeats, intraop),
            "threads": threadpar.launch(
                threadpar_ranks,
                repeats,
                world_size=RANKS,
                devices="cpu",
                intraop_threads=intraop,
                rank_cores=EVERY_CORE,
            )[0],
        }
        for name, result in runs.items():
            for key, values in result.items():
                samples[name].setdefault(key, []).extend(values)
    print(f"# load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    rows = []
    for nbytes in SIZES:
        key = str(nbytes)
        t_gloo, t_hier, t_threads = (statistics.median(samples[n][key]) for n in ("gloo", "hier", "threads"))
        busbw = lambda t: nbytes / t * 2 * (RANKS - 1) / RANKS / 1e9  # noqa: B023, E731
        rows.append(
            [
                fmt_bytes(nbytes),
                fmt_time(t_gloo),
                fmt_time(t_hier),
                fmt_time(t_threads),
                f"{busbw(t_gloo):.2f} / {busbw(t_hier):.2f}" if nbytes >= MIB else "-",
                f"{t_gloo / t_hier:.2f}x",
            ]
        )
    headers = [
        "size",
        "gloo, 4 processes",
        "threadpar, 2 processes x 2 threads",
        "threadpar, 1 process x 4 threads",
        "busbw GB/s (gloo / 2x2)",
        "speed-up 2x2 vs gloo",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
