"""The one-command GPU check: everything a machine with one GPU (or more) can tell about threadpar, in one
bounded run (about 8 minutes at most), written to a short report.

    python -m benchmarks.gpu_check [--out gpu_check.md] [--budget 420]

Each step is a subprocess with its own time limit, in priority order, and the run stops starting steps
when the budget is spent; a failing step is reported and the next one runs. Steps: the machine's facts
(torch, CUDA, NCCL through threadpar's binding, whether torch.cuda.nccl.init_rank works on this Python);
`pytest -m cuda` (the NCCL contract suite on real NCCL, the GPU tier); the selftest; the host cost per
collective by way into NCCL; point to point (NCCL's memory per communicator by torch.cuda.mem_get_info, the
host time of a send, a receive and a pipeline step); a training step eager and as a CUDA graph; one rank
thread's training step against a plain loop; two processes sharing the GPU as two NCCL hosts; the demo with --check on one GPU and with 8 ranks sharing it; ranks sharing the GPU
against the same steps run one after another. Without a GPU every step still runs and says what it could
not do, so the command is checked on CPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

FACTS = r"""
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    from threadpar.comm.nccl.library import candidate_paths, nccl_library
    lib = nccl_library()
    print(f"NCCL {'.'.join(map(str, lib.version()))} through threadpar's binding ({lib.lib._name}; tried {candidate_paths()})")
    import torch.cuda.nccl as tnccl
    try:
        tnccl.init_rank(1, tnccl.unique_id(), 0)
        print("torch.cuda.nccl.init_rank: works on this Python")
    except Exception as error:
        print(f"torch.cuda.nccl.init_rank: {type(error).__name__}: {error}")
"""


class Step(NamedTuple):
    name: str
    command: list[str]
    timeout_s: int


def steps(quick: bool) -> list[Step]:
    py = sys.executable
    demo_steps = "5" if quick else "20"
    return [
        Step("machine", [py, "-c", FACTS], 60),
        # (the notebook test needs nbformat, which a bare GPU machine may lack; it has no cuda test)
        Step(
            "pytest -m cuda",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-m",
                "cuda",
                "-p",
                "no:cacheprovider",
                "--ignore=tests/test_notebook.py",
                "tests",
            ],
            150,
        ),
        Step("selftest", [py, "-m", "threadpar.selftest", "--sizes", "4K,1M,16M", "--iters", "10"], 90),
        Step("host cost per collective", [py, "-m", "benchmarks.nccl_host_cost", "--calls", "300"], 60),
        Step(
            "point to point: NCCL memory per communicator, host cost per send/receive and per pipeline step",
            [py, "-m", "benchmarks.gpu_p2p", "--calls", "300"],
            90,
        ),
        Step(
            "CUDA graphs: a step eager vs graphed",
            [py, "-m", "benchmarks.cuda_graphs", "--steps", "10", "--rounds", "2"],
            120,
        ),
        Step("communicators made vs pooled", [py, "-m", "benchmarks.nccl_comm_cost", "--launches", "3"], 60),
        Step(
            "rank thread step vs plain loop", [py, "-m", "benchmarks.rank_thread_step", "--steps", "20"], 90
        ),
        Step(
            "two processes as two NCCL hosts on one GPU (binding, then threadpar)",
            [py, "-m", "benchmarks.nccl_two_hosts"],
            100,
        ),
        Step(
            "demo, 1 GPU, --check",
            [py, "-m", "threadpar.demo", "--gpus", "1", "--model", "small", "--check", "--steps", demo_steps],
            90,
        ),
        Step(
            "demo, 1 GPU, --cuda-graphs --check",
            [
                py,
                "-m",
                "threadpar.demo",
                "--gpus",
                "1",
                "--model",
                "small",
                "--cuda-graphs",
                "--check",
                "--steps",
                demo_steps,
            ],
            90,
        ),
        Step(
            "demo --gpus 8 (ranks share the GPUs)",
            [py, "-m", "threadpar.demo", "--gpus", "8", "--steps", demo_steps],
            90,
        ),
        Step("ranks sharing a GPU vs one after another", [py, "-m", "benchmarks.shared_gpu"], 120),
    ]


def run_step(step: Step, timeout_s: float) -> tuple[str, float, str]:
    """(verdict, seconds, the output's last lines)."""
    start = time.perf_counter()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    )
    try:
        done = subprocess.run(
            step.command, capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
        )
        verdict = "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        verdict = f"TIMED OUT after {timeout_s:.0f} s"
        output = _text(expired.stdout) + _text(expired.stderr)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return verdict, time.perf_counter() - start, "\n".join(lines[-25:])


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.md"))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all steps together")
    parser.add_argument(
        "--quick", action="store_true", help="fewer demo steps (the CPU test of this command)"
    )
    parser.add_argument("--only", help="comma-separated step numbers to run (1-based)")
    args = parser.parse_args(argv)
    chosen = steps(args.quick)
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        chosen = [s for i, s in enumerate(chosen, 1) if i in keep]
    deadline = time.monotonic() + args.budget
    report = ["# threadpar GPU check", ""]
    failed = 0
    for step in chosen:
        left = deadline - time.monotonic()
        if left < 10:
            report += [f"## {step.name}: NOT RUN (budget spent)", ""]
            failed += 1
            continue
        verdict, seconds, tail = run_step(step, min(step.timeout_s, left))
        failed += verdict != "ok"
        report += [f"## {step.name}: {verdict} ({seconds:.0f} s)", "", "```", tail, "```", ""]
        args.out.write_text("\n".join(report))  # written as it goes: a cut-off run keeps what it had
        print(f"gpu_check: {step.name}: {verdict} ({seconds:.0f} s)", flush=True)
    report.append(f"{len(chosen) - failed} of {len(chosen)} steps ok")
    args.out.write_text("\n".join(report))
    print("\n".join(report))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
