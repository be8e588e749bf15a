"""One process of a 2-process x 2-rank-thread job that trains a tiny DDP model until a fault is injected.

    python tests/procs/faults.py SCENARIO [CHECKPOINT_DIR]    # under torchrun, or with RANK etc. set

Driven by benchmarks/faults.py (which starts the processes, injects signals and times the ends) for
tests/test_faults_multiprocess.py and the fault table of notes/issue-20.md. Every process prints
"process P: pid N" first, then "process P: step S" from its first rank each step; a rank that injects a
fault itself prints "process P: FAULT ..." just before. Scenarios:

- raise: rank 3 (process 1) raises ValueError at step 3;
- stuck0, stuck3: rank 0 (process 0) or rank 3 (process 1) stops calling collectives at step 3 (a Python
  loop of sleeps, as a rank stuck in a long computation), under launch(timeout=$FAULTS_STUCK_TIMEOUT)
  (the driver sets it);
- late23: ranks 2 and 3 (all of process 1) never reach their first collective (DDP's first broadcast,
  which also connects the group's gloo groups), under the same timeout;
- train: trains until a signal or a kill comes from outside (kill -9, SIGTERM, SIGINT);
- save: as train, and rank 0 also writes a checkpoint (threadpar.checkpoint.save_atomic, ~16 MB so a
  write takes a while) after every step, printing "process 0: saving step S" before each;
- resume: loads that checkpoint (every process), checks it is whole, trains 2 more steps, exits 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import threadpar
from threadpar.checkpoint import save_atomic
from threadpar.parallel import DistributedDataParallel

FAULT_STEP = 3
PADDING = 4 << 20  # float32 entries of ballast in a checkpoint (16 MB)


PROCESS = threadpar.process_env().rank  # here, not in a rank thread: there torch.distributed is the ranks'


_say_lock = threading.Lock()


def say(text: str) -> None:
    # One write per line, under a lock: print() from two rank threads at once can interleave its text and
    # its newline ("process 1: step 3process 1: FAULT ..."), and the driver then misses the FAULT line.
    with _say_lock:
        sys.stdout.write(f"process {PROCESS}: {text}\n")
        sys.stdout.flush()


def train(scenario: str, directory: Path | None, start: dict | None) -> int:
    rank = threadpar.get_rank()
    local_first = threadpar.get_thread_rank() == 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if start is not None:
        model.load_state_dict(start["model"])
    if scenario == "late23" and rank in (2, 3):
        say(f"FAULT rank {rank} never reaches its first collective")
        while True:
            time.sleep(0.05)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    first = 0 if start is None else start["step"]
    steps = first + 2 if scenario == "resume" else 10**9
    for step in range(first, steps):
        if local_first:
            say(f"step {step}")
        if step == FAULT_STEP and scenario == "raise" and rank == 3:
            say("FAULT rank 3 raises")
            raise ValueError(f"rank 3 fails on purpose at step {step}")
        if step == FAULT_STEP and scenario in ("stuck0", "stuck3") and rank == int(scenario[-1]):
            say(f"FAULT rank {rank} stops calling collectives")
            while True:
                time.sleep(0.05)
        generator = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=generator)
        loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scenario in ("save", "resume") and rank == 0:
            assert directory is not None
            say(f"saving step {step + 1}")
            state = {
                "model": model.state_dict(),
                "step": step + 1,
                "padding": torch.full((PADDING,), step + 1.0),
            }
            save_atomic(state, directory / "checkpoint.pt")
        time.sleep(0.02)
    return steps


def main() -> None:
    scenario = sys.argv[1]
    directory = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    say(f"pid {os.getpid()}")
    start = None
    if scenario == "resume":
        assert directory is not None
        start = torch.load(directory / "checkpoint.pt", weights_only=True)  # raises if half-written
        assert bool((start["padding"] == float(start["step"])).all()), "a checkpoint mixes two steps"
        say(f"resumed from step {start['step']}")
    stuck = scenario.startswith(("stuck", "late"))
    timeout = float(os.environ["FAULTS_STUCK_TIMEOUT"]) if stuck else 120.0
    threadpar.launch(train, scenario, directory, start, threads_per_process=2, devices="cpu", timeout=timeout)
    say("finished")


if __name__ == "__main__":
    main()
