"""Real processes with rank threads in each: torchrun, and plain env:// processes for failures.

Each test starts Python processes (seconds each on a small machine), so each runs many checks at once.
Deselect with `-m "not multiprocess"` where local ports cannot be opened.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.harness import free_port
from threadpar.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
PROCS = ROOT / "tests" / "procs"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def torchrun(
    script: Path | str, *args: str, nproc: int = 2, timeout: float = 120, options=(), expect_failure=False
) -> str:
    """Run `script` under torchrun --standalone; return its output, failing the test if it failed (or, with
    `expect_failure`, if it did not). `options` go to torchrun before the script (e.g. "-m" for a module)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run(
        [*command, *options, str(script), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert (done.returncode != 0) == expect_failure, output[-6000:]
    return output


def test_torchrun_processes_run_every_collective_a_pipeline_and_ddp_across_processes():
    output = torchrun(PROCS / "torchrun_checks.py")
    for process in (0, 1):
        assert f"process {process}: collectives OK" in output, output[-6000:]
        assert f"process {process}: pipeline OK" in output, output[-6000:]
        # 2 optimizers x 2 ranks here x (6 gradients + 6 parameters)
        assert f"process {process}: DDP OK (48 gradients and parameters match" in output, output[-6000:]
        assert f"process {process}: torch.distributed OK" in output, output[-6000:]


def test_a_failing_rank_or_a_dead_process_stops_every_process():
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROCS / "failure_scenarios.py")],
            cwd=ROOT,
            env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    survivor, victim = outputs
    # 1. The failing rank's own process and the other process both report it, promptly.
    assert "process 1: scenario 1: RankFailedError: rank 3 failed with ValueError: boom on purpose" in victim
    assert (
        "process 0: scenario 1: RankFailedError: rank 3 failed with RemoteRankError: "
        "rank 3 (process 1) failed with ValueError: boom on purpose" in survivor
    ), survivor
    # 2. Process 1 dies (exit code 17); process 0 stops with an error instead of waiting for it.
    assert procs[1].returncode == 17, victim
    assert procs[0].returncode == 0, survivor
    line = next(s for s in survivor.splitlines() if s.startswith("process 0: scenario 2:"))
    assert "Connection closed by peer" in line or "lost the connection" in line, line
    for text in (survivor, victim):
        for s in text.splitlines():
            if s.startswith("process ") and "(after " in s:
                assert float(s.rsplit("(after ", 1)[1].split(" s)")[0]) < 10, s


def test_the_demo_under_torchrun_spans_both_processes_learns_and_only_process_0_prints_and_writes(tmp_path):
    """`torchrun --nproc-per-node 2 -m threadpar.demo --gpus 2`: 4 ranks (pp=2 across the processes, tp=2 in
    each), then a resume on dp=2 x tp=2 (DDP across the processes). Both check their first steps against
    the single-thread model; process 0 gathers what the other process's ranks hold."""
    small = ["--gpus", "2", "--seq-len", "16", "--batch-size", "8", "--check", "--checkpoint", str(tmp_path)]
    # --tee 1: each process's stdout lines carry its prefix, [default0]: or [default1]:
    output = torchrun(
        "threadpar.demo", *small, "--steps", "8", "--out", str(tmp_path / "a"), options=["--tee", "1", "-m"]
    )
    printed = [line for line in output.splitlines() if line.startswith("[default")]
    assert printed and all(line.startswith("[default0]:") for line in printed), output[-6000:]
    assert "2 processes x 2 ranks = 4 ranks" in output and "layout dp=1 x tp=2 x pp=2" in output
    assert output.count("rank  dp  tp  pp") == 1  # the layout overview, once
    assert "check vs single-thread model, first 3 steps: match" in output, output[-6000:]
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["layout"] == {"dp": 1, "tp": 2, "pp": 2}
    losses = metrics["losses"]
    assert len(losses) == 8 and losses[-1] < 0.75 * losses[0], losses  # it learns
    # Ranks 2 and 3 (stage 1) ran in process 1: their peaks and timeline reached process 0.
    assert all(metrics["peak_memory"][str(r)]["saved_activations_bytes"] > 0 for r in range(4))
    trace = json.loads((tmp_path / "a" / "trace.json").read_text())
    assert {(e["tid"], e["cat"]) for e in trace["traceEvents"] if e.get("ph") == "X"} >= {
        (0, "forward"), (0, "backward"), (2, "forward"), (2, "backward"),
    }  # fmt: skip
    # The checkpoint is whole (stage 1's parts came from process 1): it loads into a plain GPT.
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    GPT(GPTConfig(**ckpt["config"])).load_state_dict(ckpt["model"])
    assert ckpt["step"] == 8

    resumed = torchrun(
        "threadpar.demo", *small, "--resume", "--steps", "11", "--dp", "2", "--tp", "2",
        "--out", str(tmp_path / "b"), options=["--tee", "1", "-m"],
    )  # fmt: skip
    assert "layout dp=2 x tp=2 x pp=1" in resumed and "resuming at step 8" in resumed, resumed[-6000:]
    assert "check vs single-thread model, first 3 steps: match" in resumed, resumed[-6000:]
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["first_step"] == 8

    # Process 0 reads the checkpoint to resume from; when it cannot, every process says so and exits.
    missing = tmp_path / "nowhere"
    failed = torchrun(
        "threadpar.demo", *small, "--resume", "--checkpoint", str(missing), "--steps", "11",
        options=["-m"], expect_failure=True,
    )  # fmt: skip
    for process in (0, 1):
        assert f"threadpar demo (process {process} of 2): --resume: no checkpoint at {missing}" in failed, (
            failed
        )
