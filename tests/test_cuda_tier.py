"""The `cuda` marker: on a machine without GPUs, `pytest -m cuda` collects the GPU tier and skips all of it,
saying why (tests/conftest.py); on one with GPUs it runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.gpus import gpu_count

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_pytest_m_cuda_skips_the_gpu_tier_with_the_reason_without_gpus():
    if gpu_count():
        pytest.skip("this machine has GPUs: `pytest -m cuda` runs the tier instead of skipping it")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", "tests/cuda"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-2000:]
    assert "passed" not in out and "failed" not in out and "error" not in out.lower()
    assert "needs a CUDA GPU; this machine has none" in out and "pytest -m cuda" in out
    skipped = int(out.rsplit(" skipped", 1)[0].split()[-1])
    assert skipped >= 8, out[-2000:]  # every test of the tier, none silently left out
