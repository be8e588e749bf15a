"""Pipeline schedules on threads: measured step time and bubble vs the simulator and the textbook formula.

    python -m benchmarks.pipeline              # pp=4, n=8, 7 repeats
    python -m benchmarks.pipeline --quick      # 3 repeats
    python -m benchmarks.pipeline --trace DIR  # also write one Chrome trace per schedule (open in Perfetto)

Each stage is synthetic: a chunk's forward sleeps forward_ms / v; its backward has an input-gradient part
that sleeps backward_ms / v and a weight-gradient part that sleeps weight_ms / v, on separate autograd
nodes, so a fused backward sleeps both and the zero-bubble schedules' I and W each sleep their own. A stage
costs the same whatever v, and time.sleep releases the GIL: the rank threads overlap as GPUs would, with
deterministic costs, even on a 2-core machine. What is measured is the schedule and threadpar's
per-action overhead (autograd P2P, mailboxes, Python), not kernels. (The first chunk's input needs no
gradient, so its I has nothing to do and its W sleeps both parts, as in a real model; the simulator is
given the same costs.)

Anchors: the simulator's prediction for the same plan and costs, 1F1B's bubble in the same run (ZB-H1's
should be at most 0.4 of it; its idle time is a third of 1F1B's in theory), and the textbook bubble
(pp - 1) / (n + pp - 1), divided by v for interleaved as the issue states it (Megatron's exact interleaved
figure, (pp - 1) / (v n + pp - 1), is what the simulator gives). Step time is from the first action of any
rank to the last (the timeline). "bubble/replay": the measured bubble against the simulator's for the
measured action costs, which takes the machine's late wake-ups out. "sleep overrun": how much longer the actions' compute took than asked (the OS wakes a sleeping
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
from benchmarks.wire import WireClock, install_wire
from threadpar.pipeline import (
    PipelineParallel,
    build_plan,
    measured_bubble,
    simulate,
    step_time,
    write_chrome_trace,
)

SCHEDULES = [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zb_interleaved", 2), ("zbv", 2)]


class _SleepInput(torch.autograd.Function):
    """The input path: y = x after sleeping `forward_s`; its backward (dL/dx) sleeps `backward_s`."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """The weight path: the bias w itself; its backward (dL/dw, a sum over the batch) sleeps `weight_s`."""

    @staticmethod
    def forward(ctx, w, weight_s: float):
        ctx.weight_s = weight_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.weight_s)
        return grad, None


class SleepChunk(nn.Module):
    """y = sleep_input(x + shift) + sleep_weight(w): I runs sleep_input's backward, W sleep_weight's (and, on
    the first chunk, whose input needs no gradient, the dL/dx chain down to `shift` as well)."""

    def __init__(self, width: int, forward_s: float, backward_s: float, weight_s: float) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(width))
        self.w = nn.Parameter(torch.zeros(width))
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s

    def forward(self, x):
        h = _SleepInput.apply(x + self.shift, self.forward_s, self.backward_s)
        return h + _SleepWeight.apply(self.w, self.weight_s)


def sleep_costs(plan, forward_s: float, backward_s: float, weight_s: float):
    """The simulator's cost of each action for SleepChunk stages (per chunk: the stage cost / v)."""
    v = plan.v

    def cost(a) -> float:
        if a.forward:
            return forward_s / v
        if a.key not in plan.split:
            return (backward_s + weight_s) / v  # fused
        if a.chunk == 0:  # no input gradient: I has nothing to do, W runs both parts
            return (backward_s + weight_s) / v if a.weight else 0.0
        return (weight_s if a.weight else backward_s) / v

    return cost


def worker(
    schedule: str, v: int, n: int, costs: tuple[float, float, float], repeats: int, wire: tuple | None
):
    """On every rank: a warm-up step, then `repeats` timed steps; return their timelines and the peak.
    `wire`: (prefetch, latency, clock) to run over a WireChannel, or None for the threads backend as it is."""
    forward_s, backward_s, weight_s = costs
    chunks = [SleepChunk(16, forward_s / v, backward_s / v, weight_s / v) for _ in range(v)]
    loss_fn = lambda y, t: (y - t).square().mean()  # noqa: E731
    pipe = PipelineParallel(
        chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=n, prefetch=wire is None or wire[0]
    )
    link = install_wire(pipe, wire[1], wire[2]) if wire is not None else None
    inputs, targets = torch.randn(4 * n, 16), torch.zeros(4 * n, 16)
    pp_group = threadpar.get_group("PP")
    pipe.train_step(inputs, targets)
    timelines = []
    for _ in range(repeats):
        pp_group.barrier()  # all stages start together
        pipe.train_step(inputs, targets)
        timelines.append(pipe.timeline.snapshot())
    exposed = link.exposed / (repeats + 1) if link is not None else 0.0  # per step
    return timelines, pipe.peak_saved_activations, exposed


def measure(schedule: str, v: int, args, prefetch: bool | None = None) -> dict:
    """prefetch=None: the threads backend as it is; True/False: over a WireChannel of args.wire_ms."""
    pp, n = args.pp, args.microbatches
    costs = (args.forward_ms / 1e3, args.backward_ms / 1e3, args.weight_ms / 1e3)
    wire = None if prefetch is None else (prefetch, args.wire_ms / 1e3, WireClock())
    per_rank = threadpar.launch(
        worker, schedule, v, n, costs, args.repeats, wire, world_size=pp, pp=pp, devices="cpu"
    )
    # steps[i]: every rank's timeline of the i-th timed step
    steps = [[rank[0][i] for rank in per_rank] for i in range(args.repeats)]
    plan = build_plan(schedule, pp, n, v)
    sim = simulate(plan, cost=sleep_costs(plan, *costs))
    textbook = (pp - 1) / (n + pp - 1) / v
    work = n * sum(costs) * pp  # every schedule does the same work

    def replay(step):
        """The simulator run with the costs the actions really had (sleep overshoot included): what is left
        between it and the measurement is threadpar's own overhead."""
        costs = {name: c for t in step for name, c in t.action_costs().items()}
        return simulate(plan, cost=lambda a: costs[str(a)])

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        write_chrome_trace(os.path.join(args.trace, f"pipeline_{schedule}.json"), steps[len(steps) // 2])
    return {
        "step": statistics.median(step_time(s) for s in steps),
        "overhead": statistics.median(step_time(s) / replay(s).makespan - 1 for s in steps),
        "replay_bubble": statistics.median(replay(s).bubble for s in steps),
        "overrun": statistics.median(sum(t.compute_time() for t in s) / work - 1 for s in steps),
        "bubble": statistics.median(measured_bubble(s) for s in steps),
        # idle rank-seconds: what the bubble costs, whatever the step's length
        "idle": statistics.median(pp * step_time(s) - sum(t.compute_time() for t in s) for s in steps),
        "waiting": statistics.median(sum(t.waiting_time() for t in s) for s in steps),
        "exposed": sum(rank[2] for rank in per_rank),  # transfer seconds waited out, all ranks, per step
        "predicted_idle": pp * sim.makespan - sum(sim.busy),
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
    parser.add_argument(
        "--backward-ms", type=float, default=20.0, help="input-gradient cost (I) of one stage"
    )
    parser.add_argument("--weight-ms", type=float, default=20.0, help="weight-gradient cost (W) of one stage")
    parser.add_argument("--wire-ms", type=float, default=5.0, help="transfer time of the modelled link")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--trace", metavar="DIR", help="write a Chrome trace per schedule into DIR")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    print(f"# pipeline schedules on threads ({machine_line()})")
    print(
        f"# pp={args.pp}, n={args.microbatches}, stage costs F {args.forward_ms:g} ms, I {args.backward_ms:g} ms, "
        f"W {args.weight_ms:g} ms (time.sleep; a full backward B sleeps I + W), median of {args.repeats} steps\n"
    )
    results = {schedule: measure(schedule, v, args) for schedule, v in SCHEDULES}
    print(schedule_table(results))
    base = results["1f1b"]
    zb = results["zbh1"]
    within = all(abs(r["bubble"] / r["predicted_bubble"] - 1) <= 0.10 for r in results.values())
    print(
        f"\nmeasured bubble within 10% of the simulator's for every schedule: {'yes' if within else 'NO'}; "
        f"ZB-H1's bubble / 1F1B's: {zb['bubble'] / base['bubble']:.3f} (target <= 0.40; in theory "
        f"{zb['predicted_bubble'] / base['predicted_bubble']:.3f}), its idle time / 1F1B's: "
        f"{zb['idle'] / base['idle']:.3f} (in theory {zb['predicted_idle'] / base['predicted_idle']:.3f})"
    )
    print(
        f"\n# receives posted ahead: each message over a modelled link (WireChannel) whose {args.wire_ms:g} ms "
        "transfer starts once the receive is posted; waiting = seconds in receives, summed over ranks; transfer "
        "waited out = the part of it spent on transfers after the message was sent (the rest is the schedule's "
        "own wait for the sender)\n"
    )
    rows = []
    for schedule, v in SCHEDULES:
        off, on = (measure(schedule, v, args, prefetch=flag) for flag in (False, True))
        rows.append([
            schedule, f"{off['waiting'] * 1e3:.1f} ms", f"{on['waiting'] * 1e3:.1f} ms",
            f"{on['waiting'] / off['waiting']:.2f}",
            f"{off['exposed'] * 1e3:.1f} ms", f"{on['exposed'] * 1e3:.1f} ms",
            f"{on['exposed'] / off['exposed']:.2f}",
            fmt_time(off["step"]), fmt_time(on["step"]), f"{on['step'] / off['step']:.3f}",
        ])  # fmt: skip
    headers = [
        "schedule", "waiting, prefetch off", "prefetch on", "on/off",
        "transfer waited out, off", "on", "on/off", "step, off", "step, on", "on/off",
    ]  # fmt: skip
    print(table(headers, rows))


def schedule_table(results: dict) -> str:
    base = results["1f1b"]
    rows = []
    for (schedule, v), r in zip(SCHEDULES, results.values()):
        rows.append([
            schedule, v,
            fmt_time(r["step"]), fmt_time(r["predicted_step"]), f"{r['step'] / r['predicted_step']:.3f}",
            f"{100 * r['overrun']:+.1f}%", f"{100 * r['overhead']:+.1f}%",
            f"{r['bubble']:.3f}", f"{r['predicted_bubble']:.3f}", f"{r['bubble'] / r['predicted_bubble']:.3f}",
            f"{r['bubble'] / r['replay_bubble']:.3f}",
            f"{r['bubble'] / base['bubble']:.2f} ({r['predicted_bubble'] / base['predicted_bubble']:.2f})",
            f"{r['idle'] / base['idle']:.2f} ({r['predicted_idle'] / base['predicted_idle']:.2f})",
            "/".join(map(str, r["peaks"])) + (" (= sim)" if r["peaks"] == r["predicted_peaks"] else " (sim differs!)"),
        ])  # fmt: skip
    headers = [
        "schedule", "v", "step", "simulated", "step/sim", "sleep overrun", "vs replay",
        "bubble", "bubble sim", "bubble/sim", "bubble/replay", "bubble / 1F1B's (sim)", "idle time / 1F1B's (sim)",
        "peak saved activations per stage",
    ]  # fmt: skip
    return table(headers, rows)


if __name__ == "__main__":
    main()
