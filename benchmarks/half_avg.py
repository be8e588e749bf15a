"""fp16 AVG on 3 ranks: threadpar's pre-scaled average (no overflow: issue 37 item 6) vs gloo.

    python -m benchmarks.half_avg            # 7 repeats
    python -m benchmarks.half_avg --quick    # 3 repeats

The anchor is torch.distributed over gloo, one process per rank: gloo has no AVG ("Cannot use ReduceOp.AVG
with Gloo"), so a torch user sums, then divides (`all_reduce(t); t.div_(n)`: it overflows where threadpar's
does not). A second column is threadpar doing that same sum-then-divide, to show what the pre-scaling
(one more pass over the accumulator: mul_, then add_ with alpha) costs on the threads backend. Ratios > 1
mean threadpar's AVG is faster.
"""

from __future__ import annotations

import torch

import threadpar
from benchmarks.harness import (
    EVERY_CORE,
    fmt_bytes,
    fmt_time,
    machine_line,
    median_time,
    repeats_of,
    repeats_parser,
    run_gloo,
    table,
)

RANKS = 3
KIB, MIB = 1 << 10, 1 << 20
SIZES = (64 * KIB, 4 * MIB)


def _iters(nbytes: int) -> int:
    return 100 if nbytes <= 64 * KIB else 10


def _sum_then_divide(api, t: torch.Tensor):
    def run() -> None:
        api.all_reduce(t)
        t.div_(RANKS)

    return run


def gloo_worker(rank: int, n: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    out = {}
    for nbytes in SIZES:
        fn = _sum_then_divide(dist, torch.ones(nbytes // 2, dtype=torch.float16))
        fn()
        out[str(nbytes)] = median_time(fn, iters=_iters(nbytes), repeats=repeats, sync=dist.barrier)
    return out


def threads_worker(repeats: int) -> dict[str, float]:
    out = {}
    for nbytes in SIZES:
        t = torch.ones(nbytes // 2, dtype=torch.float16)
        avg = lambda t=t: threadpar.all_reduce(t, op="AVG")  # noqa: E731
        plain = _sum_then_divide(threadpar, t)
        for name, fn in (("avg", avg), ("plain", plain)):
            fn()
            key = f"{name}:{nbytes}"
            out[key] = median_time(fn, iters=_iters(nbytes), repeats=repeats, sync=threadpar.barrier)
    return out


def _sum_then_divide_alone(inputs: list[torch.Tensor]):
    acc = inputs[0].clone()

    def run() -> None:
        acc.copy_(inputs[0])
        for p in inputs[1:]:
            acc.add_(p)
        acc.div_(len(inputs))

    return run


def _pre_scaled_alone(inputs: list[torch.Tensor]):
    from threadpar.comm.common.reduce_op import ReduceOp, accumulate_

    acc = inputs[0].clone()

    def run() -> None:
        acc.copy_(inputs[0])
        accumulate_(acc, inputs[1:], ReduceOp.AVG, len(inputs))

    return run


def arithmetic(repeats: int) -> list[list[str]]:
    """One member's reduction alone (no threads): the pre-scaled accumulate_ vs add_ twice then div_."""
    rows = []
    for nbytes in SIZES:
        inputs = [torch.rand(nbytes // 2).to(torch.float16) for _ in range(RANKS)]
        old, new = _sum_then_divide_alone(inputs), _pre_scaled_alone(inputs)
        iters = _iters(nbytes) * 5
        t_old, t_new = (median_time(fn, iters=iters, repeats=repeats) for fn in (old, new))
        rows.append([fmt_bytes(nbytes), fmt_time(t_new), fmt_time(t_old), f"{t_old / t_new:.2f}x"])
    return rows


def main() -> None:
    repeats = repeats_of(repeats_parser(__doc__).parse_args())
    print(f"# fp16 AVG, {RANKS} ranks: threadpar (pre-scaled) vs gloo sum-then-divide ({machine_line()})")
    print(f"# median of {repeats} repeats per cell\n")
    ours = threadpar.launch(threads_worker, repeats, world_size=RANKS, devices="cpu", rank_cores=EVERY_CORE)[
        0
    ]
    gloo = run_gloo(gloo_worker, RANKS, repeats)
    rows = []
    for nbytes in SIZES:
        t_avg, t_plain, t_gloo = ours[f"avg:{nbytes}"], ours[f"plain:{nbytes}"], gloo[str(nbytes)]
        rows.append(
            [
                fmt_bytes(nbytes),
                fmt_time(t_avg),
                fmt_time(t_plain),
                fmt_time(t_gloo),
                f"{t_gloo / t_avg:.2f}x",
                f"{t_plain / t_avg:.2f}x",
            ]
        )
    headers = ["size", "threadpar AVG", "threadpar sum+div", "gloo sum+div", "vs gloo", "vs sum+div"]
    print(table(headers, rows))
    print(f"\n# the arithmetic alone, one thread, {RANKS} inputs (what the pre-scaling costs)\n")
    print(table(["size", "pre-scaled", "add_ + div_", "ratio"], arithmetic(repeats)))


if __name__ == "__main__":
    main()
