"""`python -m threadpar.selftest`: the no-GPU path, and the GPU path's comparison run on the CUDA double."""

import pytest
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

from threadpar import selftest
from threadpar.testing import run_ranks


def test_without_gpus_it_says_so_and_runs_the_cpu_checks(capsys):
    assert selftest.main(["--sizes", "4K", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA devices are visible" in out and "NCCL checks are skipped" in out
    assert "9 of 9 checks passed" in out
    for name in selftest.COLLECTIVES:
        assert f"\n{name} " in out


def test_the_nccl_backend_agrees_with_the_threads_backend_and_a_wrong_result_fails():
    fake = FakeCuda()
    rows = selftest.check(lambda fn: run_fake_gpus(fn, 3, fake), lambda fn: run_ranks(fn, 3), 3, [4096], 1)
    assert [r[2] for r in rows] == ["pass"] * len(selftest.COLLECTIVES)
    assert all(r[3] > 0 and r[5] > 0 for r in rows)  # timed, with a bus bandwidth

    broken = FakeCuda()
    all_reduce = broken.nccl.all_reduce

    def off_by_one(inputs, outputs=None, **kwargs):
        all_reduce(inputs, outputs, **kwargs)
        (outputs or inputs)[1].add_(1)  # rank 1's result is wrong

    broken.nccl.all_reduce = off_by_one
    rows = selftest.check(lambda fn: run_fake_gpus(fn, 3, broken), lambda fn: run_ranks(fn, 3), 3, [4096], 0)
    verdicts = {r[0]: r[2] for r in rows}
    assert verdicts.pop("all_reduce") == "rank 1: FAIL (max |diff| 1.0)"
    assert set(verdicts.values()) == {"pass"}


@pytest.mark.parametrize(
    ("name", "n", "factor"), [("all_reduce", 4, 1.5), ("all_gather", 4, 0.75), ("send_recv", 8, 1)]
)
def test_bus_bandwidth_factors_are_nccl_tests(name, n, factor):
    assert selftest.bus_factor(name, n) == factor


def test_sizes_parse_like_nccl_tests():
    assert [selftest.parse_size(s) for s in ("8", "4K", "1M", "256MiB", "1G")] == [
        8,
        4096,
        1 << 20,
        256 << 20,
        1 << 30,
    ]
