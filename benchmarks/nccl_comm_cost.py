"""What keeping communicators across launches saves (comm/nccl/resources.CliquePool): a launch whose groups
make their NCCL communicators (ncclCommInitRank on every member, with NCCL_RUNTIME_CONNECT=0 every
algorithm's connections too) against a launch that takes the cliques a finished launch left.

    python -m benchmarks.nccl_comm_cost [--launches 5]

On the GPUs of this machine (all of them, one rank each): the median wall time of a launch that runs one
all-reduce on the world group, with the pool emptied (and its communicators destroyed) before each launch,
against the same launch with the pool kept; and their ratio. A test suite launches hundreds of times: the
difference is what each launch after the first saves. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import threadpar
from benchmarks.harness import machine_line, table


def one_all_reduce() -> None:
    t = torch.ones(1, device=threadpar.get_device())
    threadpar.all_reduce(t)
    torch.cuda.synchronize()


def launch_seconds(world_size: int) -> float:
    start = time.perf_counter()
    threadpar.launch(one_all_reduce, world_size=world_size, backend="nccl", timeout=120)
    return time.perf_counter() - start


def empty_the_pool() -> None:
    from threadpar.comm.nccl.cuda_api import nccl_runtime, release_pooled

    release_pooled(nccl_runtime().cliques)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nccl_comm_cost: needs a CUDA GPU; none here")
        return 0
    n = torch.cuda.device_count()
    launch_seconds(n)  # (CUDA and NCCL's own first use: not counted)
    fresh, pooled = [], []
    for _ in range(args.launches):
        empty_the_pool()
        fresh.append(launch_seconds(n))
        pooled.append(launch_seconds(n))  # takes the clique the launch before left
    empty_the_pool()
    rows = [
        [
            n,
            f"{statistics.median(fresh) * 1e3:.1f} ms",
            f"{statistics.median(pooled) * 1e3:.1f} ms",
            f"{statistics.median(fresh) / statistics.median(pooled):.1f}x",
        ]
    ]
    print(f"# a launch with one all-reduce ({machine_line()}); median of {args.launches}\n")
    print(table(["ranks", "communicators made", "communicators pooled", "made / pooled"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
