"""`python -m benchmarks.gpu` on a machine without GPUs says so and exits 0; its measuring and table code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.gpus import gpu_count

import threadpar
from benchmarks.gpu import rows
from benchmarks.gpu_work import MIB, GptShape, all_reduce_times
from threadpar.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_without_gpus_it_says_so_and_exits_0():
    if gpu_count() >= 2:
        pytest.skip("this machine has GPUs: the benchmark would run")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA GPUs are visible" in proc.stdout and "nothing to compare" in proc.stdout


def test_all_reduce_times_checks_the_result_and_times_each_size():
    def body():
        return all_reduce_times(threadpar, threadpar.get_device(), 2, [4096, MIB], repeats=2)

    for times in run_ranks(body, 2):
        assert set(times) == {"4096", str(MIB)} and all(t > 0 for t in times.values())

    class WrongSum:  # an all-reduce that forgets the other rank
        barrier = staticmethod(lambda: None)
        all_reduce = staticmethod(lambda t: t)

    with pytest.raises(RuntimeError, match=r"all_reduce of ones over 2 ranks gave 1\.0"):
        all_reduce_times(WrongSum, torch.device("cpu"), 2, [4096], repeats=1)


def test_the_table_gives_nccl_tests_bus_bandwidth_and_ratios():
    ours = {"all_reduce": {str(MIB): 1e-3}, "ddp_step": 0.5}
    theirs = {"all_reduce": {str(MIB): 2e-3}, "ddp_step": 1.0}
    table = rows(ours, theirs, (300.0, 100.0), [MIB], GptShape("tiny", 8, 2), 4)
    # 1 MiB in 1 ms: algbw 1.048576 GB/s; busbw x 2(n-1)/n = 1.5 for 4 ranks
    assert table[0] == ["all_reduce 1 MiB: busbw GB/s", "1.6", "0.8", "2.00x"]
    assert table[1] == ["DDP GPT step (tiny): tokens/s", "128", "64", "2.00x"]  # 4 x 2 x 8 tokens per step
    assert table[2][1:] == ["300", "100", "3.00x"]


def test_the_zero_table_reports_each_allocator_peak_against_ddps():
    from benchmarks.gpu import zero_rows

    rows = zero_rows({"DDP": 4 * MIB, "ZeRO-1": 3 * MIB, "ZeRO-2": 2 * MIB})
    assert [r[0] for r in rows] == ["demo --zero 0 (DDP)", "demo --zero 1 (ZeRO-1)", "demo --zero 2 (ZeRO-2)"]
    assert [r[2] for r in rows] == ["1.000", "0.750", "0.500"]
    assert all(r[1] == "n/a (CPU)" for r in zero_rows(dict.fromkeys(("DDP", "ZeRO-1", "ZeRO-2"))))
