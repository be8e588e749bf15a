"""The per-collective host path of two threadpar source trees, side by side in one run.

    python -m benchmarks.host_path_ab --before /path/to/old/checkout            # this tree is "after"
    python -m benchmarks.host_path_ab --before OLD --after NEW --rounds 5

Small messages (4 bytes) on 2 CPU rank threads (`--world-size 1`: one, so no wait for a peer), through the module-level functions a user calls
(`threadpar.all_reduce(t)`, `broadcast(t, src=0)`, `send`/`recv`, `barrier()`): their time is the host
path (argument handling, the rendezvous, the wake-ups), not the data. Each round runs both trees once, in
alternating order, each in a fresh subprocess; the table shows the median over rounds of each tree's
per-call median, wall-clock and the rank thread's CPU time (time.thread_time: less disturbed by other
processes on a busy machine), and the ratios before / after (> 1: the new tree is faster). With one rank
it also counts the Python calls per op (deterministic).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

OPS = ["all_reduce", "broadcast", "send_recv", "barrier"]
ITERS = 2000


def _worker(iters: int, world_size: int) -> dict[str, float]:
    """Run in a subprocess from its source text, so that the old tree need not have this module."""
    import statistics
    import sys
    import time

    import torch

    import threadpar

    def measure() -> dict[str, float]:
        rank = threadpar.get_rank()
        t = torch.ones(1)
        calls = {
            "all_reduce": lambda: threadpar.all_reduce(t),
            "broadcast": lambda: threadpar.broadcast(t, src=0),
            "send_recv": (lambda: threadpar.send(t, dst=1))
            if rank == 0
            else (lambda: threadpar.recv(t, src=0)),
            "barrier": lambda: threadpar.barrier(),
        }
        if world_size == 1:
            del calls["send_recv"]  # (no peer)
        out = {}
        for name in calls:
            fn = calls[name]
            for _ in range(50):
                fn()
            samples, cpu = [], []
            for _ in range(5):
                threadpar.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                for _ in range(iters // 5):
                    fn()
                cpu.append((time.thread_time() - start_cpu) / (iters // 5))
                samples.append((time.perf_counter() - start) / (iters // 5))
            out[name] = statistics.median(samples)
            out[f"{name}:cpu"] = statistics.median(cpu)  # this thread's CPU time: less hurt by a busy machine
            if world_size == 1:  # nothing waits: the count of Python calls per op is deterministic
                counted = [0]

                def count(frame, event, arg, counted=counted):
                    counted[0] += event == "call"

                sys.setprofile(count)
                for _ in range(100):
                    fn()
                sys.setprofile(None)
                out[f"{name}:calls"] = counted[0] / 100
        return out

    return threadpar.launch(measure, world_size=world_size, devices="cpu", backend="threads")[0]


def _run(tree: Path, iters: int, world_size: int) -> dict[str, float]:
    code = f"{inspect.getsource(_worker)}\nimport json\nprint(json.dumps(_worker({iters}, {world_size})))"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--before", type=Path, required=True, help="the old tree (its threadpar/ is imported)"
    )
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=ITERS)
    parser.add_argument(
        "--world-size", type=int, default=2, help="1: the host path without a peer to wait for"
    )
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        for label, tree in order if r % 2 == 0 else order[::-1]:
            runs[label].append(_run(tree, args.iters, args.world_size))
    print(
        f"# host path per call, {args.world_size} CPU rank thread(s), 4-byte tensors; median of {args.rounds} "
        "alternating rounds"
    )
    counts = args.world_size == 1
    calls = f"{'Python calls per op':>22}" if counts else ""
    print(
        f"{'op':<12}{'before us':>11}{'after us':>11}{'before/after':>14}"
        f"{'CPU before':>12}{'CPU after':>11}{'before/after':>14}{calls}"
    )
    for op in [op for op in OPS if op in runs["after"][0]]:
        row = f"{op:<12}"
        for key, pad in ((op, 11), (f"{op}:cpu", 12)):
            before = statistics.median(run[key] for run in runs["before"]) * 1e6
            after = statistics.median(run[key] for run in runs["after"]) * 1e6
            row += f"{before:>{pad}.1f}{after:>11.1f}{before / after:>13.2f}x"
        if counts:
            row += f"{runs['before'][0][op + ':calls']:>14.0f} -> {runs['after'][0][op + ':calls']:.0f}"
        print(row)


if __name__ == "__main__":
    main()
