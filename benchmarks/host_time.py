"""Host time per rank and step of the GPT, threadpar's share of it, and the share that holds the GIL.

    python -m benchmarks.host_time                      # every case, threads / 2 processes x 4 / 8 processes
    python -m benchmarks.host_time --case tp --as threads --gil
    python -m benchmarks.host_time --compile both       # eager and every GPT block torch.compile'd (aot_eager)
    python -m benchmarks.host_time --report DIR         # the tables of a run kept with --keep DIR

On a GPU the device does the math and a rank's step can be no shorter than its host work; in one process
the rank threads share one GIL, so the step can be no shorter than the SUM of the ranks' GIL-held host work.
This runs GPT-2 small's shape (12 layers x 768, but 16 heads so that tp=8 divides them; a 512-token vocabulary, so that the embedding
does not dominate) with a batch so small (1 sequence of --seq tokens per replica) that the CPU math is a
small part of the step: the host-bound regime of a fast GPU.

Cases (8 ranks each): ddp (dp=8), tp (tp=8), 3d (dp 2 x tp 2 x pp 2, 1F1B, 4 microbatches) and demo (the
demo's own run: the 'tiny' GPT, batch 32 x 64 tokens, 2 x 2 x 2). Ways to run the 8 ranks: `threads` (one
process, `threads` backend), `2x4` (2 processes x 4 threads, hierarchical backend over gloo), `8x1` (8
processes). The collectives' math (what NCCL does on a GPU) runs on the CPU here. (A null device, as
benchmarks.nccl_launch uses, cannot run a model: DDP's and the pipeline's collectives carry data that the
next step depends on, such as DDP's check that every rank wraps the same model.)

Per rank and step: wall time, the rank thread's CPU time (time.thread_time: its Python and the torch ops it
ran itself). With --gil the run is sampled by py-spy (`record --gil`: each sample is the stack of the thread
that holds the GIL), which gives each rank's GIL-held time and where it went: threadpar's collectives, DDP
hooks, the pipeline executor, TP mappings, the order check, against the model, torch and the rest. From the
GIL-held time, the projected lower bound of an 8-GPU step from host work: threads = the sum over the ranks
(one GIL), processes = the largest rank's (a GIL each), 2 x 4 = the largest process's sum.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

import threadpar
from benchmarks.harness import fmt_time, machine_line, run_gloo, table

CASES = ("ddp", "tp", "3d", "demo")
WAYS = ("threads", "2x4", "8x1")
RANKS = 8


@dataclass(frozen=True)
class Case:
    name: str
    dp: int
    tp: int
    pp: int
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 16  # GPT-2 small has 12; 16 heads of 48 so that tp=8 divides them
    vocab: int = 512
    seq: int = 16
    batch: int = 0  # global batch in sequences (0: one per DP replica)
    microbatches: int = 1
    steps: int = 4
    warmup: int = 2
    compile: bool = False
    compile_backend: str = "aot_eager"

    @property
    def global_batch(self) -> int:
        return self.batch or self.dp * self.microbatches


def make_case(name: str, seq: int, steps: int, compile: bool, backend: str) -> Case:
    common = dict(seq=seq, steps=steps, compile=compile, compile_backend=backend)
    if name == "ddp":
        return Case("ddp", 8, 1, 1, **common)
    if name == "tp":
        return Case("tp", 1, 8, 1, **common)
    if name == "3d":
        return Case("3d", 2, 2, 2, microbatches=4, **common)
    # the demo's defaults: GPT 'tiny' (4 x 64, vocab 256), batch 32 x 64, 2 x 2 x 2, 1F1B, 2 x pp microbatches
    return Case(
        "demo", 2, 2, 2, n_layer=4, n_embd=64, n_head=4, vocab=256, seq=64, batch=32, microbatches=4,
        steps=steps, compile=compile, compile_backend=backend,
    )  # fmt: skip


def gpt_config(case: Case):
    from threadpar.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=case.vocab,
        block_size=case.seq,
        n_layer=case.n_layer,
        n_head=case.n_head,
        n_embd=case.n_embd,
    )


def dense_state(case: Case) -> dict[str, torch.Tensor]:
    from threadpar.models.gpt import GPT

    return GPT(gpt_config(case)).init_weights(torch.Generator().manual_seed(0)).state_dict()


# one rank ----------------------------------------------------------------------------------------------------------
def rank_run(case_dict: dict, state: dict[str, torch.Tensor]) -> dict:
    """Build this rank's part of the GPT, warm up, then time `steps` steps. Returns per-step seconds."""
    from threadpar.models.parallelize_gpt import parallelize_gpt
    from threadpar.runtime.context import get_coords, get_device

    case = Case(**case_dict)
    backend = case.compile_backend if case.compile else None
    model = parallelize_gpt(gpt_config(case), state, num_microbatches=case.microbatches, compile=backend)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(case.vocab, (case.global_batch, case.seq + 1), generator=g)
    per_replica = case.global_batch // case.dp
    dp = get_coords().dp
    mine = tokens[dp * per_replica : (dp + 1) * per_replica].to(get_device())
    inputs, targets = mine[:, :-1], mine[:, 1:]

    def step() -> None:
        model.train_step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(case.warmup):
        _warmup_step(step)
    threadpar.barrier()
    walls, cpus = [], []
    for _ in range(case.steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        _timed_step(step)
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    threadpar.barrier()
    return {
        "rank": threadpar.get_rank(),
        "pid": os.getpid(),
        "tid": threading.get_native_id(),
        "wall": statistics.median(walls),
        "cpu": statistics.median(cpus),
        "steps": case.steps,
    }


def _warmup_step(step) -> None:  # a name the profile filters out
    step()


def _timed_step(step) -> None:  # the profile counts only samples under this frame
    step()


# ways to run 8 ranks -------------------------------------------------------------------------------------------
def layout(case: Case) -> dict:
    return dict(dp=case.dp, tp=case.tp, pp=case.pp)


def run_threads(case: Case) -> list[dict]:
    state = dense_state(case)
    return threadpar.launch(
        rank_run, asdict(case), state, world_size=RANKS, devices="cpu", backend="threads", timeout=600.0,
        **layout(case),
    )  # fmt: skip


def process_worker(rank: int, processes: int, case_dict: dict) -> list[dict]:
    import torch.distributed as dist

    case = Case(**case_dict)
    threads = RANKS // processes
    results = threadpar.launch(
        rank_run, case_dict, dense_state(case), threads_per_process=threads, timeout=600.0, **layout(case)
    )
    everyone: list = [None] * processes
    dist.all_gather_object(everyone, results)
    return [r for part in everyone for r in part]


def run_processes(case: Case, processes: int) -> list[dict]:
    return run_gloo(process_worker, processes, asdict(case))


def run_way(case: Case, way: str) -> list[dict]:
    if way == "threads":
        return run_threads(case)
    return run_processes(case, int(way.split("x")[0]))


# the profile ---------------------------------------------------------------------------------------------------
# Where a GIL-held sample's time goes, by the innermost frame in threadpar (first match wins): threadpar's
# own work, or the model's (whose leaf frame is the GPT's code or torch's Python).
PROCESS_RE = re.compile(r'process (\d+):"')
CATEGORIES = (
    ("order check", ("comm/common/rendezvous.py:_mismatch", "comm/common/call_check.py")),
    ("collectives", ("threadpar/comm/",)),
    ("DDP hooks", ("parallel/ddp/",)),
    ("ZeRO", ("parallel/zero/",)),
    (
        "TP mappings",
        ("tensor_parallel/mappings.py", "tensor_parallel/collectives.py", "tensor_parallel/async_linear"),
    ),
    ("pipeline executor", ("threadpar/pipeline/",)),
    ("runtime", ("threadpar/runtime/",)),
)
THREADPAR_CATEGORIES = tuple(name for name, _ in CATEGORIES)


def categorise(frames: list[str]) -> str:
    """frames: py-spy's frames, outermost first, each "function (path:line)"."""
    leaf = frames[-1]
    if "/threadpar/" not in leaf:
        if "/torch/_dynamo/" in leaf or "/torch/_inductor/" in leaf or "/torch/_functorch/" in leaf:
            return "torch.compile"
        return "torch / other"
    path = leaf[leaf.rfind("(") + 1 :]
    function = leaf[: leaf.rfind(" (")]
    where = path.split(":")[0] + ":" + function
    for name, needles in CATEGORIES:
        if any(n in where for n in needles):
            return name
    return "model (GPT, TP layers)"


def parse_profile(path: str, results: list[dict]) -> dict[int, dict[str, float]]:
    """Samples per rank and category, from py-spy's raw output, of the timed steps only."""
    by_thread = {(r["pid"], r["tid"]): r["rank"] for r in results}
    samples: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    # A line: 'process PID:"command line";[process PID:"...";]thread (TID)[: name];frame;...;frame COUNT'
    # (a spawned process's line names its parent first; command lines may hold ';').
    with open(path) as f:
        for line in f:
            head, sep, rest = line.rstrip("\n").partition(";thread (")
            if not sep or "_timed_step" not in rest:
                continue
            pids = PROCESS_RE.findall(head)
            tid, _, rest = rest.partition(")")
            stack, _, count = rest.partition(";")[2].rpartition(" ")
            rank = by_thread.get((int(pids[-1]), int(tid))) if pids else None
            if rank is not None:
                samples[rank][categorise(stack.split(";"))] += int(count)
    return samples


# reporting -----------------------------------------------------------------------------------------------------
def report(case: Case, way: str, results: list[dict], profile, rate: float) -> tuple[list, dict]:
    wall = statistics.median(r["wall"] for r in results)
    cpu = [r["cpu"] for r in results]
    row = [
        case.name + (" (compiled)" if case.compile else ""),
        way,
        "threads" if way == "threads" else "hierarchical",
    ]
    row += [fmt_time(wall), fmt_time(statistics.median(cpu)), fmt_time(max(cpu))]
    summary: dict = {
        "wall": wall,
        "cpu_median": statistics.median(cpu),
        "tokens_per_s": case.global_batch * case.seq / wall,
    }
    if profile is not None:
        steps = case.steps
        gil = {r: sum(c.values()) / rate / steps for r, c in profile.items()}
        ours = {r: sum(c[k] for k in THREADPAR_CATEGORIES) / rate / steps for r, c in profile.items()}
        per_process = RANKS // (1 if way == "threads" else int(way.split("x")[0]))
        sums = [sum(gil.get(r, 0.0) for r in range(p, p + per_process)) for p in range(0, RANKS, per_process)]
        row += [
            fmt_time(statistics.median(gil.values())),
            fmt_time(statistics.median(ours.values())),
            fmt_time(sum(gil.values())),
            fmt_time(max(gil.values())),
            fmt_time(max(sums)),
        ]
        totals: dict[str, float] = defaultdict(float)
        for c in profile.values():
            for k, v in c.items():
                totals[k] += v / rate / steps / RANKS
        summary.update(gil=gil, ours=ours, categories=dict(totals))
    row.append(f"{summary['tokens_per_s']:.0f}")
    return row, summary


def headers(profiled: bool) -> list[str]:
    h = ["case", "ranks as", "backend", "step (wall)", "rank CPU, median", "rank CPU, max"]
    if profiled:
        h += [
            "GIL-held / rank",
            "threadpar's GIL-held / rank",
            "bound: 1 process (sum)",
            "bound: processes (max)",
            "bound: 2 x 4 (max process sum)",
        ]
    return [*h, "tokens/s"]


def child_main(args: argparse.Namespace) -> None:
    """Run the cells and write their raw results to --json (the parent, under py-spy or not, reports)."""
    if args.compile != "off":
        import torch._dynamo  # noqa: F401  (before the launches: they raise its recompile limits then)
    out = []
    for name in args.case:
        for compiled in (False, True) if args.compile == "both" else (args.compile == "on",):
            case = make_case(name, args.seq, args.steps, compiled, args.compile_backend)
            for way in args.ways:
                results = run_way(case, way)
                out.append({"case": asdict(case), "way": way, "results": results})
                print(
                    f"# {case.name}{' compiled' if compiled else ''} as {way}: done",
                    file=sys.stderr,
                    flush=True,
                )
    with open(args.json, "w") as f:
        json.dump(out, f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--as", dest="ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (GPT-2 small shape cases)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off")
    parser.add_argument(
        "--compile-backend",
        default="aot_eager",
        help="torch.compile backend of --compile (inductor: slow here)",
    )
    parser.add_argument("--gil", action="store_true", help="sample with py-spy --gil (pip install py-spy)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--keep", help="a directory to keep the raw profile and results in")
    parser.add_argument("--report", help="print the tables of a run kept with --keep (runs nothing)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # child mode: write raw results here
    args = parser.parse_args()
    if args.json:
        child_main(args)
        return
    if args.report:
        raw = os.path.join(args.report, "profile.txt")
        report_all(os.path.join(args.report, "results.json"), raw if os.path.exists(raw) else None, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = os.path.join(tmp, "profile.txt"), os.path.join(tmp, "results.json")
        child = [sys.executable, "-m", "benchmarks.host_time", *sys.argv[1:], "--json", out]
        child = [a for a in child if a != "--gil"]  # (--keep goes to the child too: it ignores it)
        if args.gil:
            child = ["py-spy", "record", "--gil", "--threads", "--subprocesses", "--full-filenames", "--nonblocking",
                     "-r", str(args.rate), "-f", "raw", "-o", raw, "--", *child]  # fmt: skip
        subprocess.run(child, check=True, stdout=subprocess.DEVNULL if args.gil else None)
        if not os.path.exists(out):
            sys.exit("host_time: the run failed (its error is above)")
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            for kept in (raw, out):
                if os.path.exists(kept):
                    shutil.copy(kept, args.keep)
        report_all(out, raw if args.gil else None, args)


def report_all(out: str, raw: str | None, args: argparse.Namespace) -> None:
    with open(out) as f:
        cells = json.load(f)
    print(f"# host time per rank and step of 8 ranks ({machine_line()}); median of {args.steps} steps")
    rows, summaries = [], []
    for cell in cells:
        case = Case(**cell["case"])
        profile = parse_profile(raw, cell["results"]) if raw else None
        row, summary = report(case, cell["way"], cell["results"], profile, args.rate)
        rows.append(row)
        summaries.append((case, cell["way"], summary))
    print(table(headers(raw is not None), rows))
    print_ratios(summaries)
    if raw is not None:
        print_profile(summaries)


def print_ratios(summaries) -> None:
    base = {(c.name, c.compile): s["tokens_per_s"] for c, way, s in summaries if way == "2x4"}
    lines = [
        f"{c.name}{' (compiled)' if c.compile else ''}: 1 process x 8 threads = {s['tokens_per_s'] / base[(c.name, c.compile)]:.2f}x of 2 x 4"
        for c, way, s in summaries
        if way == "threads" and (c.name, c.compile) in base
    ]
    if lines:
        print("\n# tokens/s, threads against 2 processes x 4 threads, side by side in this run")
        print("\n".join(lines))


def print_profile(summaries) -> None:
    names = sorted({k for _, _, s in summaries for k in s["categories"]})
    rows = []
    for case, way, s in summaries:
        total = sum(s["categories"].values()) or 1.0
        rows.append(
            [case.name + (" (compiled)" if case.compile else ""), way]
            + [
                f"{fmt_time(s['categories'].get(n, 0.0))} ({100 * s['categories'].get(n, 0.0) / total:.0f}%)"
                for n in names
            ]
        )
    print("\n# where the GIL-held time of a rank's step went (mean over ranks; py-spy --gil)")
    print(table(["case", "ranks as", *names], rows))


if __name__ == "__main__":
    main()
