"""Shared benchmark plumbing: medians of repeated timings, gloo process groups, and tables of ratios.

The anchor most benchmarks compare against is torch.distributed over gloo with one process per rank,
spawned here so both sides run in one process tree, one after the other, on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

# `rank_cores` for the benchmarks of parallel math: every core, as their anchors have (gloo's processes, a
# dense model on as many threads); by default a process's CPU rank threads share one (DESIGN.md rule 9).
EVERY_CORE = "all"


def median_time(
    fn: Callable[[], None],
    *,
    iters: int,
    repeats: int,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    finish: Callable[[], None] | None = None,
) -> float:
    """Median over `repeats` of the mean time of `iters` calls to fn (seconds). `sync` runs before each
    repeat outside the timing (a barrier, so all ranks start together); `finish` after the calls inside it
    (a barrier, so the time covers every rank's calls, not only this one's). `clock`: e.g.
    time.process_time for the CPU time of the whole process."""
    samples = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = clock()
        for _ in range(iters):
            fn()
        if finish is not None:
            finish()
        samples.append((clock() - start) / iters)
    return statistics.median(samples)


def repeats_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line with --repeats N and --quick (3 repeats); read them with `repeats_of`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    return parser


def repeats_of(args: argparse.Namespace) -> int:
    return 3 if args.quick else args.repeats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank: int, world_size: int, port: int, out_path: str, fn: Callable, args: tuple) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on *_tensor names
    torch.set_num_threads(1)  # one process per rank: each gets one core's worth of threads
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args: Any) -> Any:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes joined by a gloo group; return
    rank 0's (JSON-serialisable) result. `fn` must be a module-level function (it is pickled)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(
            _gloo_entry, args=(world_size, free_port(), out_path, fn, args), nprocs=world_size, join=True
        )
        with open(out_path) as f:
            return json.load(f)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (readable in a terminal too)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def machine_line() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"torch {torch.__version__}, {cores} cores, CUDA {'yes' if torch.cuda.is_available() else 'no'}"
