"""The host-cost benchmark runs end to end on its null device (it broke once when the double grew a mode)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_nccl_launch_benchmark_prints_its_table():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.nccl_launch",
            "--quick",
            "--ranks",
            "2",
            "--no-gloo",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 2 "))
    assert "us" in row and "x" in row, row
