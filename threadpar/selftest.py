"""`python -m threadpar.selftest`: check the collectives of this machine and report their bandwidth.

On a node with GPUs it runs every collective and point-to-point on all visible GPUs with the `nccl`
backend, compares each result with the `threads` backend given the same inputs (on CPU), and prints a
pass/fail table with time and bandwidth per collective and size, as nccl-tests reports them:
algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather, reduce-scatter,
all-to-all, scatter and gather, x 1 for broadcast, reduce and send/recv. "size" is the buffer of
all-reduce, broadcast, reduce and send/recv, the all-gather output, the reduce-scatter and all-to-all input,
and the root's whole list for scatter and gather. Without GPUs (or without NCCL) it says so and checks the
`threads` backend on CPU against results computed directly. Inputs are small integers stored as float32,
so every reduction order gives the exact same result and results must match exactly. Exit status 1 on a
failed check.

    python -m threadpar.selftest                      # all GPUs, sizes 4 KiB, 1 MiB, 64 MiB
    python -m threadpar.selftest --sizes 8,1M,256M --iters 50
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import threadpar
from threadpar.comm.nccl.cuda_api import torch_cuda
from threadpar.runtime.devices import cuda_device_count
from threadpar.runtime.launch import available_cores

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "scatter", "gather",
    "send_recv",
)  # fmt: skip
GPU_SIZES = (4 << 10, 1 << 20, 64 << 20)
CPU_SIZES = (4 << 10, 256 << 10)
Runner = Callable[[Callable[[], Any]], list[Any]]  # runs a body on every rank, returns the per-rank results


def bus_factor(name: str, n: int) -> float:
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n
    return 1.0


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def numel_for(nbytes: int, n: int) -> int:
    """float32 elements for `nbytes`, a multiple of the group size (what splits into n equal chunks)."""
    return max(n, nbytes // 4 // n * n)


def make_input(name: str, nbytes: int, rank: int, numel: int) -> torch.Tensor:
    """Small integers as float32: every summation order gives the same, exact result."""
    seed = 1_000_003 * COLLECTIVES.index(name) + 7919 * rank + nbytes
    return torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def case_op(name: str, nbytes: int, n: int, device: torch.device):
    """(run, outputs) for one collective on this rank: run() does it once, outputs() are what to check."""
    rank, numel = threadpar.get_rank(), numel_for(nbytes, n)
    x = make_input(name, nbytes, rank, numel).to(device)
    chunk = numel // n
    if name == "all_reduce":
        return (lambda: threadpar.all_reduce(x)), (lambda: [x])
    if name == "broadcast":
        return (lambda: threadpar.broadcast(x, src=0)), (lambda: [x])
    if name == "reduce":
        return (lambda: threadpar.reduce(x, dst=0)), (lambda: [x] if rank == 0 else [])
    if name in ("all_gather", "gather"):
        mine = x[:chunk]
        if name == "gather":
            outs = [torch.empty_like(mine) for _ in range(n)] if rank == 0 else None
            return (lambda: threadpar.gather(mine, outs, dst=0)), (lambda: outs or [])
        out = torch.empty(numel, device=device)
        return (lambda: threadpar.all_gather_into_tensor(out, mine)), (lambda: [out])
    if name == "reduce_scatter":
        out = torch.empty(chunk, device=device)
        return (lambda: threadpar.reduce_scatter_tensor(out, x)), (lambda: [out])
    if name == "all_to_all":
        out = torch.empty_like(x)
        return (lambda: threadpar.all_to_all_single(out, x)), (lambda: [out])
    if name == "scatter":
        out = torch.empty(chunk, device=device)
        parts = list(x.split(chunk)) if rank == 0 else None
        return (lambda: threadpar.scatter(out, parts, src=0)), (lambda: [out])
    got = torch.empty_like(x)  # send_recv: a ring; sends are buffered, so everyone sends first

    def send_recv() -> None:
        threadpar.send(x, dst=(rank + 1) % n)
        threadpar.recv(got, src=(rank - 1) % n)

    return send_recv, (lambda: [got])


def expected(name: str, nbytes: int, n: int) -> list[list[torch.Tensor]]:
    """What each rank must hold after `name`, computed directly from every rank's inputs."""
    numel, chunk = numel_for(nbytes, n), numel_for(nbytes, n) // n
    xs = [make_input(name, nbytes, r, numel) for r in range(n)]
    total = torch.stack(xs).sum(0)
    return [_expected_on(name, rank, xs, total, chunk) for rank in range(n)]


def _expected_on(name: str, rank: int, xs: list[torch.Tensor], total: torch.Tensor, chunk: int):
    n = len(xs)
    return {
        "all_reduce": lambda: [total],
        "broadcast": lambda: [xs[0]],
        "reduce": lambda: [total] if rank == 0 else [],
        "all_gather": lambda: [torch.cat([x[:chunk] for x in xs])],
        "gather": lambda: [x[:chunk] for x in xs] if rank == 0 else [],
        "reduce_scatter": lambda: [total[rank * chunk : (rank + 1) * chunk]],
        "all_to_all": lambda: [torch.cat([x[rank * chunk : (rank + 1) * chunk] for x in xs])],
        "scatter": lambda: [xs[0][rank * chunk : (rank + 1) * chunk]],
        "send_recv": lambda: [xs[(rank - 1) % n]],
    }[name]()


def cases(n: int, sizes: Sequence[int]) -> list[tuple[str, int]]:
    return [(name, size) for name in COLLECTIVES for size in sizes if not (name == "send_recv" and n < 2)]


def measure(todo: list[tuple[str, int]], iters: int) -> dict:
    """On each rank: every case once for its outputs (on CPU), then `iters` timed runs (0: none)."""
    device, n = threadpar.get_device(), threadpar.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = {}
    for name, nbytes in todo:
        run, outputs = case_op(name, nbytes, n, device)
        run()
        got = [t.to("cpu", copy=True) for t in outputs()]  # a copy: the timed runs below change them
        seconds = None
        if iters:
            run()  # warm-up
            sync()
            threadpar.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            sync()
            threadpar.barrier()  # the slowest rank's time
            seconds = (time.perf_counter() - start) / iters
        results[name, nbytes] = (got, seconds)
    return results


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    if len(got) != len(want):
        return f"FAIL ({len(got)} outputs, expected {len(want)})"
    for g, w in zip(got, want):
        if g.shape != w.shape or not torch.equal(g, w):
            diff = (g - w).abs().max().item() if g.shape == w.shape else "shape"
            return f"FAIL (max |diff| {diff})"
    return "pass"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def check(subject: Runner, reference: Runner | None, n: int, sizes: Sequence[int], iters: int) -> list[tuple]:
    """Run every case on `subject`, check rank by rank against `reference` (another backend on the same inputs)
    or, when None, against results computed directly. Returns table rows; the check column says pass/FAIL."""
    todo = cases(n, sizes)
    results = subject(lambda: measure(todo, iters))
    wanted = reference(lambda: measure(todo, 0)) if reference is not None else None
    rows = []
    for name, nbytes in todo:
        wants = [w[name, nbytes][0] for w in wanted] if wanted else expected(name, nbytes, n)
        verdicts = [compare(results[rank][name, nbytes][0], wants[rank]) for rank in range(n)]
        failed = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v != "pass"), "pass")
        seconds = results[0][name, nbytes][1]
        size = 4 * numel_for(nbytes, n)
        algbw = size / seconds / 1e9 if seconds else float("nan")
        rows.append((name, fmt_bytes(size), failed, seconds, algbw, algbw * bus_factor(name, n)))
    return rows


def print_table(rows: list[tuple]) -> None:
    print(f"{'collective':<15}{'size':>10}  {'check':<24}{'time':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for name, size, verdict, seconds, algbw, busbw in rows:
        when = f"{seconds * 1e6:9.1f}us" if seconds else "-"
        print(f"{name:<15}{size:>10}  {verdict:<24}{when:>11}{algbw:12.2f}{busbw:12.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m threadpar.selftest", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 8,4K,1M,256M")
    parser.add_argument("--iters", type=int, help="timed runs per collective and size")
    args = parser.parse_args(argv)
    n_gpus = cuda_device_count()
    nccl = n_gpus > 0 and torch_cuda().nccl_available()
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else GPU_SIZES if nccl else CPU_SIZES
    iters = args.iters or (20 if nccl else 5)
    if nccl:
        n = n_gpus
        print(f"threadpar selftest: {n} GPU(s), NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"torch {torch.__version__}; nccl backend vs threads backend (CPU) on the same inputs")  # fmt: skip
        subject = lambda fn: threadpar.launch(fn, world_size=n, backend="nccl")  # noqa: E731
        reference = lambda fn: threadpar.launch(fn, world_size=n, devices="cpu", backend="threads")  # noqa: E731
    else:
        n = 4
        why = "no CUDA devices are visible" if n_gpus == 0 else "this torch build has no NCCL"
        print(f"threadpar selftest: {why} (torch {torch.__version__}), so the NCCL checks are skipped; "
              f"running the CPU checks: the threads backend on {n} CPU threads vs results computed directly")  # fmt: skip
        subject = lambda fn: threadpar.launch(fn, world_size=n, devices="cpu", backend="threads")  # noqa: E731
        reference = None
    print(f"{available_cores()} CPU cores; {iters} timed runs per case and size", flush=True)
    rows = check(subject, reference, n, sizes, iters)
    print_table(rows)
    failed = [r for r in rows if r[2] != "pass"]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks passed" + ("" if not failed else "; FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
