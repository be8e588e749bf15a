"""Tensor parallelism: an MLP block split over TP rank threads vs the dense block, with and without the
backward overlap of the input-gradient collective with the weight-gradient GEMM, and its communication.

    python -m benchmarks.tp              # hidden 1024, ffn 4096, batch 8 x seq 256, tp = 2
    python -m benchmarks.tp --quick      # fewer repeats

The block is fc1 (column-parallel) -> gelu -> fc2 (row-parallel), forward + backward, fp32 on CPU.
Times: median over rounds of the mean of `iters` steps; every rank runs with `--threads-per-rank` torch
intra-op threads. Each round times the dense block (on rank 0 while the other ranks wait: the anchor,
"one thread" by default), TP and TP + SP one after the other, so load from outside hits all three alike.
For context, the dense block also runs with as many threads as all TP ranks together (the same cores).
A step ends when its slowest rank is done, so TP times are the slowest rank's. With one thread per rank,
"CPU time/rank" is the step's CPU time on the rank's own thread (compute and copies, not waits): on a
machine shared with other work it shows the split of the work that wall-clock times can hide.

Overlap: "TP" and "TP + SP" run with ColumnParallelLinear(overlap_grad_comm=False) and "+ overlap" with
True (the default), side by side in every round. Time in collectives, two ways: "blocked in collectives"
is the time the rank thread spends inside blocking collectives and in `Work.wait()` of asynchronous ones
(what the overlap hides no longer counts); "compute only" times the non-overlapped step again with every
collective of the TP group replaced by a no-op (results are garbage, the work is the same), and "comm
share" = 1 - compute only / step is the part of the step that communication costs.

Bytes: the TP group handle's collectives are wrapped to record every call, so the table shows what the
layers actually send, next to the theoretical count per block (N = batch * seq * hidden * 4 bytes):
without SP one all-reduce of N forward (fc2's output) and one backward (fc1's input gradient); with SP an
all-gather and a reduce-scatter of N in each direction, and with the overlap one more all-gather of N in
backward (fc1 keeps only its input's sequence shard and gathers it again, as Megatron does). "Sent per rank" is what a ring algorithm moves
per rank: 2(P-1)/P * N for an all-reduce, (P-1)/P * N for an all-gather or reduce-scatter.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_bytes, fmt_time, machine_line, median_time, table
from threadpar.parallel import ColumnParallelLinear, RowParallelLinear

# ProcessGroup method -> the collective it is (all_reduce itself goes through all_reduce_coalesced)
COUNTED = {
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
}


def ring_factor(op: str, p: int) -> float:
    return 2 * (p - 1) / p if op.startswith("all_reduce") else (p - 1) / p


def collective_size(op: str, args: tuple) -> int:
    """Bytes of the collective as nccl-tests counts them: the all-reduce buffer, the all-gather output,
    the reduce-scatter input."""
    if op == "all_reduce_coalesced":
        tensors = args[0]
    elif op == "all_gather_into_tensor":
        tensors = [args[0]]
    elif op == "reduce_scatter_tensor":
        tensors = [args[1]]
    elif op == "all_gather":
        tensors = args[0]
    else:  # reduce_scatter(output, input_list)
        tensors = args[1]
    return sum(t.numel() * t.element_size() for t in tensors)


class _Done:
    """The Work of a collective replaced by a no-op."""

    def wait(self, timeout=None) -> bool:
        return True


class _TimedWork:
    """Forwards to a Work; adds the time spent in `wait()` to the counter's."""

    def __init__(self, work, counter: CollectiveCounter) -> None:
        self._work, self._counter = work, counter

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._counter.seconds += time.perf_counter() - start


class CollectiveCounter:
    """Wraps the collectives of one ProcessGroup handle (the one the layers captured): records every call
    as (phase, op, bytes) while `phase` is set, adds the time the rank is blocked in them (a blocking call,
    or `wait()` on an asynchronous one's Work), and turns them into no-ops while `noop` is set."""

    def __init__(self, group) -> None:
        self.phase: str | None = None
        self.calls: list[tuple[str, str, int]] = []
        self.seconds = 0.0
        self.noop = False
        for op in COUNTED:
            setattr(group, op, self._wrap(op, getattr(group, op)))

    def _wrap(self, op, method):
        signature = inspect.signature(method)

        def counted(*args, **kwargs):
            if self.phase is not None:
                self.calls.append((self.phase, COUNTED[op], collective_size(op, args)))
            async_op = signature.bind(*args, **kwargs).arguments.get("async_op", False)
            if self.noop:
                return _Done() if async_op else None
            start = time.perf_counter()
            try:
                work = method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
            return _TimedWork(work, self) if async_op else work

        return counted


class MLP(nn.Module):
    def __init__(self, fc1, fc2) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):  # [batch, seq, hidden] (seq split under SP) -> same
        return self.fc2(F.gelu(self.fc1(x)))


def dense_mlp(hidden: int, ffn: int) -> MLP:
    g = torch.Generator().manual_seed(0)
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return MLP(fc1, fc2)


def step(model, x, grad_out) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).backward(grad_out)


CASES = ("dense", "tp", "tp_overlap", "sp", "sp_overlap", "tp_compute", "sp_compute")
LABELS = {
    "tp": "TP={tp}",
    "tp_overlap": "TP={tp} + overlap",
    "tp_compute": "TP={tp}, compute only",
    "sp": "TP={tp} + SP",
    "sp_overlap": "TP={tp} + SP + overlap",
    "sp_compute": "TP={tp} + SP, compute only",
}


def rank_main(dense: MLP, x: torch.Tensor, grad_out: torch.Tensor, iters: int, repeats: int):
    """One TP rank: build the TP and TP+SP blocks (overlap off and on) from the dense one, record their
    collectives, then time every case in turn (dense on rank 0, the other ranks idle), `repeats` rounds, so
    that load from outside the benchmark hits all of them alike."""
    group = threadpar.get_group("TP")
    tp, rank = group.size(), group.rank()
    counter = CollectiveCounter(group)
    cases: dict[str, tuple[Any, ...]] = {}
    for name in CASES[1:5]:
        sp, overlap = name.startswith("sp"), name.endswith("overlap")
        model = MLP(
            ColumnParallelLinear.from_dense(dense.fc1, sequence_parallel=sp, overlap_grad_comm=overlap),
            RowParallelLinear.from_dense(dense.fc2, sequence_parallel=sp),
        )
        # under SP each rank holds its slice of the sequence
        xi, gi = (t.chunk(tp, dim=1)[rank].contiguous() if sp else t for t in (x, grad_out))
        xi = xi.clone().requires_grad_()
        counter.calls, counter.phase = [], "fwd"
        y = model(xi)
        counter.phase = "bwd"
        y.backward(gi)
        counter.phase = None
        cases[name] = (model, xi, gi, y.detach(), counter.calls)
    for mode in ("tp", "sp"):  # the overlapped backward computes the same gradients
        plain, overlapped = cases[mode][0], cases[f"{mode}_overlap"][0]
        for a, b in zip(plain.parameters(), overlapped.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-4)
        cases[f"{mode}_compute"] = cases[mode]  # the non-overlapped block, its collectives no-ops
    if rank == 0:
        cases["dense"] = (dense, x.clone().requires_grad_(), grad_out, None, None)

    samples: dict[str, list[float]] = {name: [] for name in cases}
    cpu_samples: dict[str, list[float]] = {
        name: [] for name in cases
    }  # this thread's CPU time: what load from outside can't inflate
    blocked = {name: 0.0 for name in cases}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name in CASES:
            group.barrier()
            if name not in cases:
                continue  # dense runs on rank 0 only
            model, xi, gi, _, _ = cases[name]
            counter.seconds, counter.noop = 0.0, name.endswith("compute")
            cpu = time.thread_time()
            seconds = median_time(functools.partial(step, model, xi, gi), iters=iters, repeats=1)
            counter.noop = False
            if round_:
                samples[name].append(seconds)
                cpu_samples[name].append((time.thread_time() - cpu) / iters)
                blocked[name] += counter.seconds
    result: dict[str, Any] = {name: statistics.median(times) for name, times in samples.items()}
    result.update({f"{name}_cpu": statistics.median(times) for name, times in cpu_samples.items()})
    for name in CASES[1:5]:
        result[f"{name}_rounds"] = samples[name]  # per round, for paired ratios
        result[f"{name}_blocked"] = blocked[name] / (iters * sum(samples[name]))
        result[f"{name}_out"], result[f"{name}_calls"] = cases[name][3], cases[name][4]
    return result


def fmt_signed(seconds: float) -> str:
    """A difference of two medians, which noise can make negative."""
    return f"-{fmt_time(-seconds)}" if seconds < 0 else fmt_time(seconds)


def dense_main(dense: MLP, x: torch.Tensor, grad_out: torch.Tensor, iters: int, repeats: int) -> float:
    """The dense block on one rank with all the TP ranks' threads."""
    x = x.clone().requires_grad_()
    step(dense, x, grad_out)  # warm-up
    return median_time(lambda: step(dense, x, grad_out), iters=iters, repeats=repeats)


def theory(sp: bool, overlap: bool, n_bytes: int) -> dict[str, list[tuple[str, int]]]:
    if sp:
        # forward: fc1 gathers its input, fc2 reduce-scatters its output; backward: the conjugates, reversed,
        # and with the overlap fc1 gathers its input again (it kept only its shard) before the reduce-scatter
        again = [("all_gather", n_bytes)] if overlap else []
        return {"fwd": [("all_gather", n_bytes), ("reduce_scatter", n_bytes)],
                "bwd": [("all_gather", n_bytes), *again, ("reduce_scatter", n_bytes)]}  # fmt: skip
    # forward: fc2's output; backward: fc1's input gradient
    return {"fwd": [("all_reduce", n_bytes)], "bwd": [("all_reduce", n_bytes)]}


def describe(calls: list[tuple[str, int]]) -> str:
    counts: defaultdict[tuple[str, int], int] = defaultdict(int)
    for op, nbytes in calls:
        counts[(op, nbytes)] += 1
    return " + ".join(f"{n}x {op} {fmt_bytes(b)}" for (op, b), n in counts.items()) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 iteration x 3 repeats")
    args = parser.parse_args()
    iters, repeats = (1, 3) if args.quick else (args.iters, args.repeats)
    tp, threads = args.tp, args.threads_per_rank
    dense = dense_mlp(args.hidden, args.ffn)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    grad_out = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    n_bytes = x.numel() * x.element_size()

    print(f"# tensor parallelism: MLP block {args.hidden} -> {args.ffn} -> {args.hidden}, batch {args.batch} x "
          f"seq {args.seq}, fp32, tp = {tp}, {threads} intra-op thread(s) per rank ({machine_line()})")  # fmt: skip
    print(
        f"# forward + backward; median of {repeats} rounds of {iters} step(s); each round times every row in turn"
    )
    print(
        "# (dense on rank 0 while the other ranks wait); overlap = ColumnParallelLinear(overlap_grad_comm=True)\n"
    )
    per_rank = threadpar.launch(
        rank_main,
        dense,
        x,
        grad_out,
        iters,
        repeats,
        world_size=tp,
        tp=tp,
        devices="cpu",
        intraop_threads=threads,
        rank_cores=EVERY_CORE,
    )
    wide = threadpar.launch(
        dense_main,
        dense,
        x,
        grad_out,
        iters,
        repeats,
        world_size=1,
        devices="cpu",
        intraop_threads=threads * tp,
    )[0]
    with torch.no_grad():
        want = dense(x)
    for name in CASES[1:5]:  # the timed code computes the dense result
        outs = [r[f"{name}_out"] for r in per_rank]
        out = torch.cat(outs, dim=1) if name.startswith("sp") else outs[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)

    base = per_rank[0]["dense"]
    speedup = lambda seconds: f"{base / seconds:.2f}x"  # noqa: E731
    # With one thread per rank all of a rank's work runs on its own thread, so its CPU time per step is
    # the rank's share of the work, whatever else the machine runs: dense CPU / slowest rank CPU is the
    # speed-up TP would reach with a free core per rank.
    base_cpu = per_rank[0]["dense_cpu"]
    cpu_cell = lambda seconds: f"{fmt_time(seconds)} ({base_cpu / seconds:.2f}x)" if threads == 1 else "-"  # noqa: E731
    step_of = {name: max(r[name] for r in per_rank) for name in CASES[1:]}  # the slowest rank's
    rows = [
        [f"dense, {threads} thread(s)", fmt_time(base), speedup(base), cpu_cell(base_cpu), "-", "-"],
        [f"dense, {threads * tp} threads", fmt_time(wide), speedup(wide), "-", "-", "-"],
    ]
    for name in CASES[1:]:
        seconds = step_of[name]
        cpu = max(r[f"{name}_cpu"] for r in per_rank)
        label = f"{LABELS[name].format(tp=tp)}, {threads} thread(s)/rank"
        if name.endswith("compute"):
            blocked = share = "-"
        else:
            blocked = f"{100 * max(r[f'{name}_blocked'] for r in per_rank):.0f}%"
            compute = step_of[f"{name.removesuffix('_overlap')}_compute"]
            share = f"{100 * (1 - compute / seconds):.0f}%"
        rows.append([label, fmt_time(seconds), speedup(seconds), cpu_cell(cpu), blocked, share])
    headers = [
        "model",
        "fwd+bwd",
        f"speed-up vs dense {threads} thread(s)",
        "CPU time/rank (speed-up)",
        "blocked in collectives",
        "comm share (1 - compute only / step)",
    ]
    print(table(headers, rows))

    print("\n# the overlap side by side (exposed communication = step - compute only; paired: the median")
    print("# over rounds of the ratio within a round, which load that drifts between rounds affects less)\n")
    rows = []
    for mode, label in (("tp", f"TP={tp}"), ("sp", f"TP={tp} + SP")):
        plain, overlapped, compute = (step_of[n] for n in (mode, f"{mode}_overlap", f"{mode}_compute"))
        # per round, the slowest rank's time of each case
        rounds = [
            map(max, zip(*(r[f"{name}_rounds"] for r in per_rank))) for name in (mode, f"{mode}_overlap")
        ]
        paired = statistics.median(a / b for a, b in zip(*rounds))
        rows.append([
            label, fmt_time(plain), fmt_time(overlapped), f"{plain / overlapped:.2f}x", f"{paired:.2f}x",
            fmt_signed(plain - compute), fmt_signed(overlapped - compute),
        ])  # fmt: skip
    headers = [
        "mode", "step, no overlap", "step, overlap", "speed-up from overlap", "paired",
        "exposed comm, no overlap", "exposed comm, overlap",
    ]  # fmt: skip
    print(table(headers, rows))

    print(f"\n# bytes per rank per MLP block (N = batch*seq*hidden*4 = {fmt_bytes(n_bytes)})\n")
    rows = []
    for name in CASES[1:5]:
        sp, overlap = name.startswith("sp"), name.endswith("overlap")
        calls = [r[f"{name}_calls"] for r in per_rank]
        if any(c != calls[0] for c in calls):
            raise RuntimeError("the TP ranks made different collective calls")
        want = theory(sp, overlap, n_bytes)
        for phase in ("fwd", "bwd"):
            got = [(op, b) for p, op, b in calls[0] if p == phase]
            sent = sum(b * ring_factor(op, tp) for op, b in got)
            expected = sum(b * ring_factor(op, tp) for op, b in want[phase])
            rows.append([
                LABELS[name].format(tp=tp), phase, describe(got), describe(want[phase]),
                fmt_bytes(int(sent)), fmt_bytes(int(expected)), f"{sent / expected:.2f}",
            ])  # fmt: skip
    headers = ["mode", "phase", "measured (every rank)", "theory", "sent/rank", "theory sent/rank", "ratio"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
