"""What clipping pays to find each parameter's gradient placement: the rank's table of parameter records vs
the Parameter attribute it replaced (issue 21).

    python -m benchmarks.param_records            # 100 and 400 parameters
    python -m benchmarks.param_records --quick    # fewer repeats

Both sides run on the same rank thread (a launch of one rank), one after the other: `grad_placements(params)` (what
clip_grad_norm_ calls every step) for a DDP-wrapped model of N small Linear layers, and the anchor, one
`getattr(param, "grad_placement")` per parameter (the old marker, set here on the same parameters). Ratios
> 1 mean the table costs that many times the attribute read; the absolute time is what a step pays. Times
are the rank thread's CPU time (time.thread_time), medians of the repeats.
"""

from __future__ import annotations

import time

from torch import nn

import threadpar
from benchmarks.harness import fmt_time, machine_line, median_time, repeats_of, repeats_parser, table
from threadpar.parallel import DistributedDataParallel, grad_placements

ITERS = 50


def measure(n: int, repeats: int) -> tuple[float, float]:
    def body() -> tuple[float, float]:
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n // 2)])
        DistributedDataParallel(model)
        params = list(model.parameters())
        for param, placement in zip(params, grad_placements(params)):
            param.grad_placement = placement  # the old marker, for the anchor

        def attribute() -> None:
            for param in params:
                getattr(param, "grad_placement", None)

        # CPU time of this thread: on a loaded machine wall time mostly measures the other processes.
        anchor = median_time(attribute, iters=ITERS, repeats=repeats, clock=time.thread_time)
        records = median_time(
            lambda: grad_placements(params), iters=ITERS, repeats=repeats, clock=time.thread_time
        )
        return anchor, records

    # One rank: a second rank thread timing the same loop would make each wait for the GIL in the other's
    # slices, which measures the interpreter's switch interval, not the lookup.
    return threadpar.launch(body, world_size=1, backend="threads", devices="cpu", intraop_threads=1)[0]


def main() -> None:
    args = repeats_parser(__doc__).parse_args()
    rows = []
    for n in (100, 400):
        anchor, records = measure(n, repeats_of(args))
        rows.append([n, fmt_time(anchor), fmt_time(records), f"{records / anchor:.1f}x"])
    print(machine_line())
    print(table(["parameters", "attribute (anchor)", "records table", "table / attribute"], rows))


if __name__ == "__main__":
    main()
