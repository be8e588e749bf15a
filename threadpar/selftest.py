"""`python -m threadpar.selftest`: check the collectives of this machine and report their bandwidth.

On a node with GPUs it runs every collective and point-to-point on all visible GPUs with the `nccl`
backend, compares each result with the `threads` backend given the same inputs (on CPU), and prints a
pass/fail table with time and bandwidth per collective and size. Rooted collectives use the LAST rank as
root, point-to-point also pairs the last rank with the first, AVG runs on 3 ranks (1/3 is inexact) and
two cases run on sub-groups; a DDP step and a pipeline step (threadpar.selftest_models) close the table.
Bandwidths are as nccl-tests reports them:
algbw = size / time; busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather, reduce-scatter,
all-to-all, scatter and gather, x 1 for broadcast, reduce and send/recv. "size" is the buffer of
all-reduce, broadcast, reduce and send/recv, the all-gather output, the reduce-scatter and all-to-all input,
and the root's whole list for scatter and gather. Without GPUs (or without NCCL) it says so and checks the
`threads` backend on CPU (3 rank threads) against results computed directly. Inputs are small integers
stored as float32, so every summation order gives the exact same result and results must match exactly,
except AVG and the model steps (a stated tolerance). Exit status 1 on a failed check.

    python -m threadpar.selftest                      # all GPUs, sizes 4 KiB, 1 MiB, 64 MiB
    python -m threadpar.selftest --sizes 8,1M,256M --iters 50
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import threadpar
from threadpar.comm.common.gpu import is_gpu
from threadpar.comm.nccl.cuda_api import nccl_runtime
from threadpar.runtime import context
from threadpar.runtime.devices import cuda_device_count
from threadpar.runtime.launch import available_cores
from threadpar.selftest_models import LABELS as MODEL_LABELS
from threadpar.selftest_models import check_models

# Roots are the LAST rank and the point-to-point pair is last <-> first: member 0 is the case a wrong root
# (a broadcast that always sent from NCCL rank 0, as torch.cuda.nccl's does) or a wrong index gets right by accident.
COLLECTIVES = (
    "all_reduce", "avg_3_ranks", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "scatter",
    "gather", "send_recv", "send_recv_ends", "subgroup_bcast",
)  # fmt: skip
LABELS = {
    "avg_3_ranks": "all_reduce AVG, last 3 ranks",
    "broadcast": "broadcast src=last",
    "reduce": "reduce dst=last",
    "scatter": "scatter src=last",
    "gather": "gather dst=last",
    "send_recv": "send/recv ring",
    "send_recv_ends": "send/recv last<->first",
    "subgroup_bcast": "broadcast, group 1..n-1",
}
# AVG is the one case where exact equality is wrong: NCCL multiplies each input by 1/n before summing
# (issue 14, defect 9), the threads backend sums and then divides; both round differently by a few ulp.
AVG_TOLERANCE = (1e-5, 1e-5)  # rtol, atol as torch.allclose takes them
GPU_SIZES = (4 << 10, 1 << 20, 64 << 20)
CPU_SIZES = (4 << 10, 256 << 10)
Runner = Callable[..., list[Any]]  # runner(fn, **layout): runs fn on every rank, returns the per-rank results


def members(name: str, n: int) -> list[int]:
    """The ranks a case runs on: a sub-group for two cases, else the world."""
    if name == "avg_3_ranks":
        return list(range(max(0, n - 3), n))
    if name == "subgroup_bcast" and n >= 3:
        return list(range(1, n))  # its member 0 is world rank 1, its last member world rank n-1
    return list(range(n))


def bus_factor(name: str, n: int) -> float:
    """nccl-tests' factor from algbw to busbw for `n` ranks (its doc/PERFORMANCE.md and src/*.cu)."""
    if name in ("all_reduce", "avg_3_ranks"):
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


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


def case_op(name: str, nbytes: int, n: int, device: torch.device, groups: dict[tuple[int, ...], Any]):
    """(run, outputs) for one case on this rank: run() does it once, outputs() are what to check.
    `groups` keeps the sub-groups made so far (made once per launch, as a program would)."""
    rank, numel = threadpar.get_rank(), numel_for(nbytes, n)
    x = make_input(name, nbytes, rank, numel).to(device)
    chunk, last = numel // n, n - 1
    ranks = members(name, n)
    group = None
    if len(ranks) < n:
        key = tuple(ranks)
        group = groups[key] = groups.get(key) or threadpar.new_group(ranks)
    if rank not in ranks:
        return (lambda: None), (lambda: [])
    if name == "all_reduce":
        return (lambda: threadpar.all_reduce(x)), (lambda: [x])
    if name == "avg_3_ranks":
        return (lambda: threadpar.all_reduce(x, op="avg", group=group)), (lambda: [x])
    if name in ("broadcast", "subgroup_bcast"):
        return (lambda: threadpar.broadcast(x, src=ranks[-1], group=group)), (lambda: [x])
    if name == "reduce":
        return (lambda: threadpar.reduce(x, dst=last)), (lambda: [x] if rank == last else [])
    if name in ("all_gather", "gather"):
        mine = x[:chunk]
        if name == "gather":
            outs = [torch.empty_like(mine) for _ in range(n)] if rank == last else None
            return (lambda: threadpar.gather(mine, outs, dst=last)), (lambda: outs or [])
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
        parts = list(x.split(chunk)) if rank == last else None
        return (lambda: threadpar.scatter(out, parts, src=last)), (lambda: [out])
    got = torch.empty_like(x)  # sends are buffered, so everyone sends first
    if name == "send_recv_ends":  # the last and the first rank swap their buffers; the others do nothing
        if rank not in (0, last) or n < 2:
            return (lambda: None), (lambda: [])
        peer = last if rank == 0 else 0
        return functools.partial(_exchange, x, got, peer, peer), (lambda: [got])
    ring = functools.partial(_exchange, x, got, (rank + 1) % n, (rank - 1) % n)  # send_recv: a ring
    return ring, (lambda: [got])


def _exchange(x: torch.Tensor, got: torch.Tensor, dst: int, src: int) -> None:
    threadpar.send(x, dst=dst)
    threadpar.recv(got, src=src)


def expected(name: str, nbytes: int, n: int) -> list[list[torch.Tensor]]:
    """What each rank must hold after `name`, computed directly from every rank's inputs."""
    numel, chunk = numel_for(nbytes, n), numel_for(nbytes, n) // n
    xs = [make_input(name, nbytes, r, numel) for r in range(n)]
    return [_expected_on(name, rank, xs, chunk) for rank in range(n)]


def _expected_on(name: str, rank: int, xs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    n, last, ranks = len(xs), len(xs) - 1, members(name, len(xs))
    if rank not in ranks:
        return []
    total = torch.stack(xs).sum(0)
    return {
        "all_reduce": lambda: [total],
        "avg_3_ranks": lambda: [torch.stack([xs[r] for r in ranks]).sum(0) / len(ranks)],
        "broadcast": lambda: [xs[last]],
        "subgroup_bcast": lambda: [xs[ranks[-1]]],
        "reduce": lambda: [total] if rank == last else [],
        "all_gather": lambda: [torch.cat([x[:chunk] for x in xs])],
        "gather": lambda: [x[:chunk] for x in xs] if rank == last else [],
        "reduce_scatter": lambda: [total[rank * chunk : (rank + 1) * chunk]],
        "all_to_all": lambda: [torch.cat([x[rank * chunk : (rank + 1) * chunk] for x in xs])],
        "scatter": lambda: [xs[last][rank * chunk : (rank + 1) * chunk]],
        "send_recv": lambda: [xs[(rank - 1) % n]],
        "send_recv_ends": lambda: [xs[last if rank == 0 else 0]] if rank in (0, last) and n > 1 else [],
    }[name]()


def cases(n: int, sizes: Sequence[int]) -> list[tuple[str, int]]:
    point_to_point = ("send_recv", "send_recv_ends")
    return [(name, size) for name in COLLECTIVES for size in sizes if not (name in point_to_point and n < 2)]


def measure(todo: list[tuple[str, int]], iters: int) -> dict:
    """On each rank: every case once for its outputs (on CPU), then `iters` timed runs (0: none)."""
    device, n = threadpar.get_device(), threadpar.get_world_size()
    sync = _device_sync(device)
    results: dict[tuple[str, int], tuple[list[torch.Tensor], float | None]] = {}
    groups: dict[tuple[int, ...], Any] = {}
    for name, nbytes in todo:
        run, outputs = case_op(name, nbytes, n, device, groups)
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


def _device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for the rank's device to finish its work (a GPU's collectives run after the host issued
    them): the launch's CudaApi, which drives any GPU threadpar runs on (comm/common/gpu.py); the host's
    work is done when issued."""
    if not is_gpu(device):
        return lambda: None
    cuda = context.current().world.cuda_api()
    return lambda: cuda.synchronize(device)


def compare(
    got: list[torch.Tensor], want: list[torch.Tensor], tolerance: tuple[float, float] | None = None
) -> str:
    """The verdict: "pass" when equal (exactly, or within `tolerance`: torch.allclose's rtol, atol)."""
    if len(got) != len(want):
        return f"FAIL ({len(got)} outputs, expected {len(want)})"
    for g, w in zip(got, want):
        same = g.shape == w.shape and (torch.allclose(g, w, *tolerance) if tolerance else torch.equal(g, w))
        if not same:
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
        tolerance = AVG_TOLERANCE if name == "avg_3_ranks" else None
        verdicts = [compare(results[rank][name, nbytes][0], wants[rank], tolerance) for rank in range(n)]
        failed = next((f"rank {r}: {v}" for r, v in enumerate(verdicts) if v != "pass"), "pass")
        ranks = members(name, n)
        seconds = results[ranks[-1]][name, nbytes][1]  # every rank's time ends at the same barrier
        size = 4 * numel_for(nbytes, n)
        algbw = size / seconds / 1e9 if seconds else float("nan")
        rows.append((name, fmt_bytes(size), failed, seconds, algbw, algbw * bus_factor(name, len(ranks))))
    return rows


def print_table(rows: list[tuple]) -> None:
    print(f"{'collective':<30}{'size':>12}  {'check':<28}{'time':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for name, size, verdict, seconds, algbw, busbw in rows:
        when = f"{seconds * 1e6:9.1f}us" if seconds else "-"
        bw = f"{algbw:12.2f}{busbw:12.2f}" if seconds else f"{'-':>12}{'-':>12}"  # the model steps: not timed
        print(f"{(LABELS | MODEL_LABELS).get(name, name):<30}{size:>12}  {verdict:<28}{when:>11}{bw}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m threadpar.selftest", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 8,4K,1M,256M")
    parser.add_argument("--iters", type=int, help="timed runs per collective and size")
    args = parser.parse_args(argv)
    n_gpus = cuda_device_count()
    nccl = n_gpus > 0 and nccl_runtime().nccl_available()
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else GPU_SIZES if nccl else CPU_SIZES
    iters = args.iters or (20 if nccl else 5)
    if nccl:
        n = n_gpus
        print(f"threadpar selftest: {n} GPU(s), NCCL {'.'.join(map(str, nccl_runtime().nccl.version()))}, "
              f"torch {torch.__version__}; nccl backend vs threads backend (CPU) on the same inputs")  # fmt: skip
        subject: Runner = functools.partial(threadpar.launch, world_size=n, backend="nccl")
        reference: Runner | None = functools.partial(
            threadpar.launch, world_size=n, devices="cpu", backend="threads"
        )
    else:
        n = 3  # odd: AVG's 1/n is inexact, and the last rank is not the middle one
        why = "no CUDA devices are visible" if n_gpus == 0 else "this torch build has no NCCL"
        print(f"threadpar selftest: {why} (torch {torch.__version__}), so the NCCL checks are skipped; "
              f"running the CPU checks: the threads backend on {n} CPU threads vs results computed directly")  # fmt: skip
        subject = functools.partial(threadpar.launch, world_size=n, devices="cpu", backend="threads")
        reference = None
    print(f"{available_cores()} CPU cores; {iters} timed runs per case and size", flush=True)
    rows = check(subject, reference, n, sizes, iters) + check_models(subject, reference, n)
    print_table(rows)
    failed = [r for r in rows if r[2] != "pass"]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks passed" + ("" if not failed else "; FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
