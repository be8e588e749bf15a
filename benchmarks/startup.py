"""Tests of parallel code: start N ranks, run collectives, finish. threadpar vs torch's threaded test process
group (what torch's MultiThreadedTestCase uses) vs torch.distributed over gloo with one process per rank.

    python -m benchmarks.startup            # 4 and 8 ranks
    python -m benchmarks.startup --quick

"start + all-reduce + finish" is what a unit test of parallel code pays before and after its body. The
latency rows time one all-reduce inside an already started group.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist

import threadpar
from benchmarks.harness import fmt_time, machine_line, median_time, run_gloo, table
from threadpar.testing import run_ranks

MIB = 1 << 20


def _threadpar_body(sizes, iters) -> dict[str, float]:
    out = {}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        threadpar.all_reduce(t)
        out[str(nbytes)] = median_time(
            lambda t=t: threadpar.all_reduce(t), iters=iters, repeats=5, sync=threadpar.barrier
        )
    return out


def threadpar_startup(n: int) -> float:
    start = time.perf_counter()
    run_ranks(lambda: threadpar.all_reduce(torch.ones(4)), n)
    return time.perf_counter() - start


def threaded_pg(n: int, body) -> list:
    """Run body(rank) on n threads joined by torch's threaded test process group; return the results."""
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        _install_threaded_pg()
        store = dist.HashStore()
        results = [None] * n

        def worker(rank: int) -> None:
            dist.init_process_group(backend="threaded", rank=rank, world_size=n, store=store)
            try:
                results[rank] = body(rank)
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


def threaded_pg_startup(n: int) -> float:
    start = time.perf_counter()
    threaded_pg(n, lambda rank: dist.all_reduce(torch.ones(4)))
    return time.perf_counter() - start


def _torch_body(sizes, iters) -> dict[str, float]:
    out = {}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(t)
        out[str(nbytes)] = median_time(
            lambda t=t: dist.all_reduce(t), iters=iters, repeats=5, sync=dist.barrier
        )
    return out


def gloo_worker(rank: int, n: int, sizes: list[int], iters: int) -> dict[str, float]:
    return _torch_body(sizes, iters)


def gloo_startup(n: int) -> float:
    start = time.perf_counter()
    run_gloo(gloo_worker, n, [4], 1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    sizes, iters = [4, 16 * MIB], 50
    print(f"# start + all-reduce + finish, and all-reduce latency ({machine_line()}); medians of {repeats}\n")
    rows = []
    for n in args.ranks:
        ours = statistics.median(threadpar_startup(n) for _ in range(repeats))
        theirs = statistics.median(threaded_pg_startup(n) for _ in range(repeats))
        gloo = statistics.median(gloo_startup(n) for _ in range(max(2, repeats // 2)))
        rows.append([f"start + all-reduce + finish, {n} ranks", fmt_time(ours), fmt_time(theirs), fmt_time(gloo),
                     f"{theirs / ours:.1f}x", f"{gloo / ours:.0f}x"])  # fmt: skip
        lat_ours = run_ranks(_threadpar_body, n, sizes, iters)[0]
        lat_theirs = threaded_pg(n, lambda rank: _torch_body(sizes, iters))[0]
        lat_gloo = run_gloo(gloo_worker, n, sizes, iters)
        for nbytes in sizes:
            a, b, c = (d[str(nbytes)] for d in (lat_ours, lat_theirs, lat_gloo))
            label = "4 B" if nbytes == 4 else f"{nbytes // MIB} MiB"
            rows.append([f"all-reduce {label}, {n} ranks", fmt_time(a), fmt_time(b), fmt_time(c),
                         f"{b / a:.1f}x", f"{c / a:.1f}x"])  # fmt: skip
    print(
        table(
            ["", "threadpar", "torch threaded PG", "gloo, 1 process/rank", "vs threaded PG", "vs gloo"], rows
        )
    )


if __name__ == "__main__":
    main()
