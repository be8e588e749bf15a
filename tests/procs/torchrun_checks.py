"""Every collective and point-to-point path across processes, under torchrun (driven by test_multiprocess.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/procs/torchrun_checks.py

Each process runs 2 rank threads. First launch (tp=2): every collective and message, on the world and DP
groups (spanning both processes) and TP groups (inside one). Second launch (pp=2): pipelines whose stages
sit in different processes, against the whole model trained in one thread. Then two launches of
DistributedDataParallel over all 4 ranks (dp=4) against one thread on the concatenated batch. One "OK" line
per check and process.
"""

import time

from checks import check_ddp, check_pipeline, run_all

import threadpar


def main() -> None:
    env = threadpar.process_env()
    threads = 2
    start = time.perf_counter()
    counts = threadpar.launch(
        run_all, env.count, threads, threads_per_process=threads, tp=2, devices="cpu", timeout=60
    )
    took = time.perf_counter() - start
    print(f"process {env.rank}: collectives OK ({sum(counts)} checks on {threads} threads, {took:.1f} s)")
    start = time.perf_counter()
    counts = threadpar.launch(check_pipeline, threads_per_process=threads, pp=2, devices="cpu", timeout=60)
    took = time.perf_counter() - start
    print(f"process {env.rank}: pipeline OK ({sum(counts)} parameters match, {took:.1f} s)")
    start = time.perf_counter()
    count = check_ddp(
        lambda body, world: threadpar.launch(body, threads_per_process=threads, devices="cpu", timeout=60),
        env.count * threads,
    )
    took = time.perf_counter() - start
    print(f"process {env.rank}: DDP OK ({count} gradients and parameters match, {took:.1f} s)")


if __name__ == "__main__":
    main()
