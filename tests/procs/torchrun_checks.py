"""Every collective and point-to-point path across processes, under torchrun (driven by test_processes.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/procs/torchrun_checks.py

Each process runs 2 rank threads (layout tp=2: the TP groups sit inside a process, the DP groups and the
world span both). Prints one "OK" line per process.
"""

import time

from checks import run_all

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


if __name__ == "__main__":
    main()
