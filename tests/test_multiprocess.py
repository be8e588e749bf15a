"""Real processes with rank threads in each: torchrun, and plain env:// processes for failures.

Each test starts Python processes (seconds each on a small machine), so each runs many checks at once.
Deselect with `-m "not multiprocess"` where local ports cannot be opened.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import free_port

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


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 120) -> str:
    """Run `script` under torchrun --standalone; return its output, failing the test if it failed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run(
        [*command, str(script), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def test_torchrun_processes_run_every_collective_a_pipeline_and_ddp_across_processes():
    output = torchrun(PROCS / "torchrun_checks.py")
    for process in (0, 1):
        assert f"process {process}: collectives OK" in output, output[-6000:]
        assert f"process {process}: pipeline OK" in output, output[-6000:]
        # 2 optimizers x 2 ranks here x (6 gradients + 6 parameters)
        assert f"process {process}: DDP OK (48 gradients and parameters match" in output, output[-6000:]


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
