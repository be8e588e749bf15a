"""The one-command GPU check runs end to end on CPU (each step says what it cannot do without a GPU), so the
first minutes of a borrowed GPU are not spent on a broken script."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_the_gpu_check_runs_its_steps_and_writes_its_report(tmp_path):
    report = tmp_path / "gpu_check.md"
    # the machine's facts, the host cost, point to point, the rank-thread step and the two-hosts probe (the
    # others are tested on their own: the selftest, the demo, the shared-GPU benchmark, pytest itself)
    command = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--quick",
        "--out",
        str(report),
        "--only",
        "1,4,5,7,8",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = report.read_text()
    assert "## machine: ok" in text and "CUDA available" in text
    assert "rank thread / main thread: wall" in text
    assert text.rstrip().endswith("5 of 5 steps ok")


@pytest.mark.timeout(200)
def test_a_step_that_fails_is_reported_and_the_check_goes_on(tmp_path, monkeypatch):
    from benchmarks import gpu_check

    failing = gpu_check.Step("fails", [sys.executable, "-c", "raise SystemExit(3)"], 30)
    passing = gpu_check.Step("passes", [sys.executable, "-c", "print('fine')"], 30)
    monkeypatch.setattr(gpu_check, "steps", lambda quick: [failing, passing])
    assert gpu_check.main(["--out", str(tmp_path / "r.md")]) == 1
    text = (tmp_path / "r.md").read_text()
    assert "## fails: FAILED (exit 3)" in text and "## passes: ok" in text and "1 of 2 steps ok" in text
