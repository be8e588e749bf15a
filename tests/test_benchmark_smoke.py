"""The host-cost benchmark runs end to end on its null device (it broke once when the double grew a mode)."""

from __future__ import annotations

import json
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


@pytest.mark.timeout(120)
def test_shared_gpu_benchmark_prints_its_ratios_and_writes_json(tmp_path):
    path = tmp_path / "shared.json"
    command = [sys.executable, "-m", "benchmarks.shared_gpu", "--quick", "--ranks", "2", "--json", str(path)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ratio k=2: " in out.stdout, out.stdout
    numbers = json.loads(path.read_text())["ranks"]["2"]
    assert numbers["ratio"] > 0 and len(numbers["rank_cpu_s"]) == 2


@pytest.mark.timeout(60)
def test_shared_gpu_memory_option_says_it_needs_cuda_without_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --memory measures instead (the GPU check runs it)")
    command = [sys.executable, "-m", "benchmarks.shared_gpu", "--memory"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 2 and "--memory needs CUDA" in out.stdout


@pytest.mark.timeout(180)
def test_cuda_graphs_benchmark_runs_its_cpu_model_and_finds_graphed_equal_to_eager():
    command = [sys.executable, "-m", "benchmarks.cuda_graphs", "--quick"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| DDP MLP"))
    assert "| True " in row, row


@pytest.mark.timeout(180)
def test_p2p_host_cost_benchmark_prints_before_and_after():
    command = [
        sys.executable, "-m", "benchmarks.p2p_host_cost", "--quick", "--calls", "20", "--steps", "1",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| exchange on the group's communicator" in out.stdout and "| after: the PP group's" in out.stdout


@pytest.mark.timeout(180)
def test_nccl_comm_count_benchmark_prices_a_layout_against_torchs_rules():
    command = [sys.executable, "-m", "benchmarks.nccl_comm_count", "--steps", "1", "--only", "pp8"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| pp8 "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1:5] == ["1", "5", "3", "1"] and cells[-2:] == ["yes", "yes"], row


@pytest.mark.timeout(180)
def test_sim_gpu_benchmark_prices_the_double_and_finds_the_same_losses():
    command = [sys.executable, "-m", "benchmarks.sim_gpu", "--repeats", "1"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=170, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| launch of 4 ranks"))
    assert row.rstrip().endswith("| yes         |"), row
