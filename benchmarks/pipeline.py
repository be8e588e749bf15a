"""Pipeline schedules on threads: measured step time and bubble vs the simulator and the textbook formula.

    python -m benchmarks.pipeline              # pp=4, n=8, 7 repeats
    python -m benchmarks.pipeline --quick      # 3 repeats
    python -m benchmarks.pipeline --trace DIR  # also write one Chrome trace per schedule (open in Perfetto)

Each stage is synthetic: a chunk's forward sleeps forward_ms / v and its backward backward_ms / v, so a
stage costs the same whatever v, and time.sleep releases the GIL: the rank threads overlap as GPUs would,
with deterministic costs, even on a 2-core machine. What is measured is the schedule and threadpar's
per-action overhead (autograd P2P, mailboxes, Python), not kernels.

Anchors: the simulator's prediction for the same plan and costs, and the textbook bubble
(pp - 1) / (n + pp - 1), divided by v for interleaved as the issue states it (Megatron's exact interleaved
figure, (pp - 1) / (v n + pp - 1), is what the simulator gives). Step time is from the first action of any
rank to the last (the timeline). "sleep overrun": how much longer the actions' compute took than asked (the OS wakes a sleeping
thread late on a loaded machine). "vs replay": the measured step against the simulator fed with each
action's measured compute time, i.e. the cost of threadpar's messages and bookkeeping alone. Medians over
repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import threadpar
from benchmarks.harness import fmt_time, machine_line, table
from threadpar.pipeline import (
    PipelineParallel,
    build_plan,
    measured_bubble,
    simulate,
    step_time,
    write_chrome_trace,
)

SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved", 2)]


class _Sleep(torch.autograd.Function):
    """y = x + w, after sleeping `forward_s`; the backward sleeps `backward_s`."""

    @staticmethod
    def forward(ctx, x, w, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x + w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, grad.sum(0), None, None


class SleepChunk(nn.Module):
    def __init__(self, width: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.forward_s, self.backward_s)


def worker(schedule: str, v: int, n: int, forward_s: float, backward_s: float, repeats: int):
    """On every rank: a warm-up step, then `repeats` timed steps; return their timelines and the peak."""
    chunks = [SleepChunk(16, forward_s / v, backward_s / v) for _ in range(v)]
    loss_fn = lambda y, t: (y - t).square().mean()  # noqa: E731
    pipe = PipelineParallel(chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=n)
    inputs, targets = torch.randn(4 * n, 16), torch.zeros(4 * n, 16)
    pp_group = threadpar.get_group("PP")
    pipe.train_step(inputs, targets)
    timelines = []
    for _ in range(repeats):
        pp_group.barrier()  # all stages start together
        pipe.train_step(inputs, targets)
        timelines.append(pipe.timeline.snapshot())
    return timelines, pipe.peak_saved_activations


def measure(schedule: str, v: int, args) -> dict:
    pp, n = args.pp, args.microbatches
    forward_s, backward_s = args.forward_ms / 1e3, args.backward_ms / 1e3
    per_rank = threadpar.launch(
        worker, schedule, v, n, forward_s, backward_s, args.repeats, world_size=pp, pp=pp, devices="cpu"
    )
    # steps[i]: every rank's timeline of the i-th timed step
    steps = [[rank[0][i] for rank in per_rank] for i in range(args.repeats)]
    plan = build_plan(schedule, pp, n, v)
    sim = simulate(plan, forward=forward_s / v, backward=backward_s / v)
    textbook = (pp - 1) / (n + pp - 1) / v

    def replay(step) -> float:
        """The simulator's step time with the costs the actions really had (sleep overshoot included):
        what is left between it and the measurement is threadpar's own overhead."""
        costs = {name: c for t in step for name, c in t.action_costs().items()}
        return simulate(plan, cost=lambda a: costs[str(a)]).makespan

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        write_chrome_trace(os.path.join(args.trace, f"pipeline_{schedule}.json"), steps[len(steps) // 2])
    return {
        "step": statistics.median(step_time(s) for s in steps),
        "overhead": statistics.median(step_time(s) / replay(s) - 1 for s in steps),
        "overrun": statistics.median(
            sum(t.compute_time() for t in s) / (n * (forward_s + backward_s) * pp) - 1 for s in steps
        ),
        "bubble": statistics.median(measured_bubble(s) for s in steps),
        "predicted_step": sim.makespan,
        "predicted_bubble": sim.bubble,
        "textbook_bubble": textbook,
        "peaks": [rank[1] for rank in per_rank],
        "predicted_peaks": list(sim.peak_in_flight),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward cost of one stage")
    parser.add_argument("--backward-ms", type=float, default=40.0, help="backward cost of one stage")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--trace", metavar="DIR", help="write a Chrome trace per schedule into DIR")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    print(f"# pipeline schedules on threads ({machine_line()})")
    print(
        f"# pp={args.pp}, n={args.microbatches}, stage costs forward {args.forward_ms:g} ms, backward "
        f"{args.backward_ms:g} ms (time.sleep), median of {args.repeats} steps\n"
    )
    rows = []
    results = {}
    for schedule, v in SCHEDULES:
        r = results[schedule] = measure(schedule, v, args)
        rows.append([
            schedule, v,
            fmt_time(r["step"]), fmt_time(r["predicted_step"]), f"{r['step'] / r['predicted_step']:.3f}",
            f"{100 * r['overrun']:+.1f}%", f"{100 * r['overhead']:+.1f}%",
            f"{r['bubble']:.3f}", f"{r['predicted_bubble']:.3f}", f"{r['textbook_bubble']:.3f}",
            "/".join(map(str, r["peaks"])) + (" (= sim)" if r["peaks"] == r["predicted_peaks"] else " (sim differs!)"),
        ])  # fmt: skip
    headers = [
        "schedule", "v", "step", "simulated", "step/sim", "sleep overrun", "vs replay",
        "bubble", "bubble sim", "bubble textbook", "peak saved activations per stage",
    ]  # fmt: skip
    print(table(headers, rows))
    within = all(abs(r["step"] / r["predicted_step"] - 1) <= 0.15 for r in results.values())
    lower = results["interleaved"]["bubble"] < results["1f1b"]["bubble"]
    print(
        f"\nstep time within 15% of the simulator for every schedule: {'yes' if within else 'NO'}; "
        f"interleaved bubble below 1F1B's: {'yes' if lower else 'NO'} "
        f"({results['interleaved']['bubble']:.3f} vs {results['1f1b']['bubble']:.3f})"
    )


if __name__ == "__main__":
    main()
