"""A torchrun script both ways: `torchrun --nproc-per-node N` (a process per rank) vs `python -m threadpar.run
--nproc-per-node N` (a thread per rank), on examples/torchrun_script.py (DDP over gloo, torchrun's variables,
manual_seed per rank, a checkpoint by rank 0, sys.exit(0)).

    python -m benchmarks.torchrun_script                 # 4 ranks, 5 rounds
    python -m benchmarks.torchrun_script --quick         # 2 rounds

Each round runs both commands as subprocesses, alternating which goes first: once with `--steps 0` (start-up:
the interpreter, torch, the ranks, init_process_group and DDP's first broadcast, and shutdown) and once with
`--steps S`. It prints the medians and ratios, checks that both ways print the same losses per rank
(torch.testing.assert_close: the all-reduce's summation order may differ in the last bits) and that the
checkpoints rank 0 wrote are close.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.harness import machine_line, table

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "torchrun_script.py"
)
LOSSES = re.compile(r"rank (\d+) \(local \d+\) losses: \[([^\]]*)\]")


def command(way: str, nproc: int, steps: int, checkpoint: str) -> list[str]:
    launcher = ["-m", "torch.distributed.run"] if way == "torchrun" else ["-m", "threadpar.run"]
    return [sys.executable, *launcher, "--nproc-per-node", str(nproc), SCRIPT, "--steps", str(steps),
            "--checkpoint", checkpoint]  # fmt: skip


def run(way: str, nproc: int, steps: int, checkpoint: str) -> tuple[float, dict[int, list[float]]]:
    start = time.perf_counter()
    done = subprocess.run(command(way, nproc, steps, checkpoint), capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{way} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    losses = {int(m[1]): [float(v) for v in m[2].split()] for m in LOSSES.finditer(done.stdout)}
    return seconds, losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    print(machine_line())
    print(f"{SCRIPT}, {args.nproc} ranks, {args.steps} steps; {rounds} rounds, medians")
    ways = ("torchrun", "threadpar.run")
    times: dict[tuple[str, int], list[float]] = {(w, s): [] for w in ways for s in (0, args.steps)}
    losses: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = {way: os.path.join(folder, f"{way}.pt") for way in ways}
        for index in range(rounds):
            order = ways if index % 2 == 0 else ways[::-1]
            for steps in (0, args.steps):
                for way in order:
                    seconds, seen = run(way, args.nproc, steps, checkpoints[way])
                    times[(way, steps)].append(seconds)
                    if steps:
                        losses[way] = seen
        assert sorted(losses["torchrun"]) == list(range(args.nproc)), losses["torchrun"]
        for rank in range(args.nproc):
            torch.testing.assert_close(
                torch.tensor(losses["threadpar.run"][rank]),
                torch.tensor(losses["torchrun"][rank]),
                rtol=1e-5,
                atol=1e-6,
            )
        saved = [torch.load(checkpoints[way]) for way in ways]
        for name in saved[0]:
            torch.testing.assert_close(saved[1][name], saved[0][name], rtol=1e-5, atol=1e-6)
    median = {key: statistics.median(samples) for key, samples in times.items()}
    rows = []
    for steps, what in (
        (0, "start-up and shutdown (--steps 0)"),
        (args.steps, f"{args.steps} steps, end to end"),
    ):
        anchor, ours = median[("torchrun", steps)], median[("threadpar.run", steps)]
        rows.append([what, f"{anchor:.2f} s", f"{ours:.2f} s", f"{ours / anchor:.2f}x"])
    print(table(["", "torchrun", "threadpar.run", "threadpar.run / torchrun"], rows))
    last = {way: losses[way][0][-1] for way in ways}
    print(
        f"losses equal on every rank (assert_close, rtol 1e-5); rank 0's last: torchrun {last['torchrun']:.6f}, "
        f"threadpar.run {last['threadpar.run']:.6f}; checkpoints close"
    )


if __name__ == "__main__":
    main()
