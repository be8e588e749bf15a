"""Failures across processes: run as 2 processes x 2 rank threads (test_processes.py sets their environment).

1. Rank 3 (process 1) raises while the others wait in a collective and in a receive: every process must
   raise RankFailedError naming rank 3 and its error, within a few seconds.
2. A second launch in the same processes (a fresh set of groups): process 1 dies mid-run (os._exit) while
   process 0's ranks wait for it in a collective: process 0 must raise promptly, not hang.
Each process prints one line per scenario, starting with "process P: scenario N:".
"""

import os
import sys
import threading
import time

import torch

import threadpar


def failing_rank() -> None:
    rank = threadpar.get_rank()
    threadpar.all_reduce(torch.ones(4))
    if rank == 3:
        time.sleep(0.2)
        raise ValueError("boom on purpose")
    if rank == 0:
        threadpar.recv(torch.empty(1), src=2)  # a message that never comes
    else:
        threadpar.barrier()


def dying_process() -> None:
    threadpar.all_reduce(torch.ones(2))
    if threadpar.get_process_rank() == 1:
        time.sleep(0.3)
        # The whole process dies: os._exit from a thread that is not a rank (in a rank thread it would end
        # only that rank, as a process per rank's exit would: runtime/rank_exit.py).
        threading.Thread(target=os._exit, args=(17,)).start()
        time.sleep(60)
    threadpar.all_reduce(torch.ones(2))  # waits for ranks that are gone


def report(process: int, scenario: int, start: float, error: BaseException | None) -> None:
    took = time.monotonic() - start
    first = "no error" if error is None else f"{type(error).__name__}: {str(error).splitlines()[0]}"
    print(f"process {process}: scenario {scenario}: {first} (after {took:.1f} s)", flush=True)


def main() -> None:
    process = threadpar.process_env().rank
    for scenario, body in ((1, failing_rank), (2, dying_process)):
        start = time.monotonic()
        try:
            threadpar.launch(body, threads_per_process=2, devices="cpu", timeout=30)
        except threadpar.ThreadparError as error:
            report(process, scenario, start, error)
        else:
            report(process, scenario, start, None)
            sys.exit(1)


if __name__ == "__main__":
    main()
