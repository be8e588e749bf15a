"""What free-threaded CPython buys rank threads: the same runs under a GIL build and a free-threaded one.

    python -m benchmarks.free_threading --gil PYTHON --free-threaded PYTHON_T
    python -m benchmarks.free_threading --gil PYTHON --free-threaded PYTHON_T --ranks 1 2 8 --demo --rounds 3

PYTHON and PYTHON_T are two interpreters of one CPython release, each with torch and this checkout
installed (docs/versions.md says how the ones measured here were built). Every run is
a fresh process of that interpreter; the rounds alternate between them, and the table shows medians.

- A Python-bound step: n rank threads (threadpar.launch on CPU threads, unpinned: rank_cores="all", one
  intra-op thread each), each running steps of small ops whose cost is the interpreter's, not the math's
  (16 x [8x8] @ [8x8] and a tanh); "+ all-reduce" ends every step with an all-reduce of the [8x8] result,
  as a training step ends with its collectives. Steps/s counts every rank's steps; "scaling" is n ranks'
  steps/s over one rank's, whose ceiling is min(n, cores): with the GIL a rank's Python waits for the
  others', free-threaded it runs on a core of its own.
- `--demo`: benchmarks.rank_cores' runs of the demo (8 ranks as 1 process x 8 rank threads and as 2
  processes x 4, each packed onto one core per process and unpinned), tokens/s.

On the 2-core machine CI uses, n rank threads share 2 cores, so no run can show more than 2x; the figures
that carry over are the ones per core. On a GPU host with 16+ cores, run the same command there (with
`--ranks 1 2 4 8`): free-threaded, the Python-bound step should scale close to n up to the cores free for
the ranks, where the GIL build stays near 1x; the demo on GPUs (`--demo` runs `--gpus 8`, which uses the
GPUs when there are any) shows how much of a step's host time was the GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import table
from benchmarks.rank_cores import PLACEMENTS, WAYS, demo_tokens_per_s

OPS_PER_STEP = 16
WARMUP_STEPS = 20  # untimed: the first steps pay one-time costs (allocator, torch's lazy set-up)


STEPS = {"ops": False, "ops + all-reduce": True}  # the step kinds: whether a step ends with an all-reduce


def _python_bound_child(ranks: int, steps: int, all_reduce: bool) -> dict[str, object]:
    """In a fresh interpreter: the seconds `ranks` rank threads take for `steps` steps each."""
    import torch

    import threadpar

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(OPS_PER_STEP):
            x = torch.tanh(x @ w)
        if all_reduce:
            threadpar.all_reduce(x)
            x = x / ranks
        return x

    def body() -> float:
        g = torch.Generator().manual_seed(threadpar.get_rank())
        x, w = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g) / 8
        for _ in range(WARMUP_STEPS):
            x = step(x, w)
        threadpar.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            x = step(x, w)
        threadpar.barrier()
        return time.perf_counter() - start

    seconds = threadpar.launch(
        body, world_size=ranks, devices="cpu", rank_cores="all", intraop_threads=1, torch_distributed=False
    )
    gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
    return {"seconds": max(seconds), "gil": gil, "torch": torch.__version__}


def _python_bound(python: str, ranks: int, steps: int, all_reduce: bool) -> dict:
    command = [python, "-m", "benchmarks.free_threading", "--child", str(ranks), "--steps", str(steps)]
    command += ["--all-reduce"] if all_reduce else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _describe(python: str) -> str:
    code = "import sys, sysconfig, platform; ft = bool(sysconfig.get_config_var('Py_GIL_DISABLED')); "
    code += "print(f'CPython {platform.python_version()}', 'free-threaded' if ft else 'GIL')"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gil", default=sys.executable, help="a GIL build with torch and threadpar")
    parser.add_argument("--free-threaded", required="--child" not in sys.argv, help="a free-threaded build")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--demo", action="store_true", help="also the demo, 1 x 8 vs 2 x 4")
    parser.add_argument("--demo-steps", type=int, default=30)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--all-reduce", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_python_bound_child(args.child, args.steps, args.all_reduce)))
        return
    builds = {"GIL": args.gil, "free-threaded": args.free_threaded}
    # A GIL build refuses to start with PYTHON_GIL=0; the free-threaded one keeps the GIL off by itself unless
    # a module that needs it is imported (the Python-bound step reports whether the GIL was on).
    os.environ.pop("PYTHON_GIL", None)
    print("# " + "; ".join(f"{name}: {_describe(python)} ({python})" for name, python in builds.items()))
    ranks = sorted({1, *args.ranks})
    rates: dict[tuple[str, str, int], list[float]] = {}
    gil_seen: dict[str, set[bool]] = {name: set() for name in builds}
    for _ in range(args.rounds):
        for kind, all_reduce in STEPS.items():
            for n in ranks:
                for name, python in builds.items():
                    run = _python_bound(python, n, args.steps, all_reduce)
                    rates.setdefault((kind, name, n), []).append(n * args.steps / run["seconds"])
                    gil_seen[name].add(bool(run["gil"]))
    med = {key: statistics.median(values) for key, values in rates.items()}
    print(
        f"\n## Python-bound steps ({OPS_PER_STEP} x 8x8 matmul + tanh; + all-reduce: then an all-reduce of the "
        f"8x8 result), steps/s of all ranks, median of {args.rounds} rounds of {args.steps} steps per rank "
        f"(GIL on during the runs: {'; '.join(f'{k} {sorted(v)}' for k, v in gil_seen.items())})\n"
    )
    rows = []
    for kind in STEPS:
        for n in ranks:
            gil, free = med[kind, "GIL", n], med[kind, "free-threaded", n]
            rows.append(
                [
                    kind,
                    n,
                    f"{gil:,.0f}",
                    f"{gil / med[kind, 'GIL', 1]:.2f}x",
                    f"{free:,.0f}",
                    f"{free / med[kind, 'free-threaded', 1]:.2f}x",
                    f"{free / gil:.2f}x",
                ]
            )
    headers = ["step", "rank threads", "GIL, steps/s", "GIL: scaling", "free-threaded, steps/s"]
    print(table([*headers, "free-threaded: scaling", "free-threaded / GIL"], rows))
    if args.demo:
        _demo(builds, args.demo_steps, args.rounds)


def _demo(builds: dict[str, str], steps: int, rounds: int) -> None:
    runs: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for placement in PLACEMENTS:
                for way in WAYS:
                    for name, python in builds.items():
                        rate = demo_tokens_per_s(way, placement, "tiny", steps, Path(tmp), python)
                        runs.setdefault((name, way, placement), []).append(rate)
    med = {key: statistics.median(values) for key, values in runs.items()}
    print(f"\n## The demo's 8 ranks (tiny GPT, dp=2 x tp=2 x pp=2), tokens/s, median of {rounds} rounds\n")
    rows = []
    for placement in PLACEMENTS:
        for name in builds:
            one, two = med[name, "1 x 8", placement], med[name, "2 x 4", placement]
            ratio = statistics.median(
                a / b for a, b in zip(runs[name, "1 x 8", placement], runs[name, "2 x 4", placement])
            )
            vs_gil = one / med["GIL", "1 x 8", placement]
            rows.append([placement, name, f"{one:,.0f}", f"{two:,.0f}", f"{ratio:.2f}x", f"{vs_gil:.2f}x"])
    headers = ["rank threads", "build", "1 x 8", "2 x 4", "1 x 8 / 2 x 4", "1 x 8: vs the GIL build"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
