"""A process's state per rank thread: torchrun's variables, seeds, sys.exit and os._exit (runtime/rank_process)."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import threadpar
from threadpar.errors import RankFailedError
from threadpar.runtime.rank_exit import RankExitError
from threadpar.testing import TEST_CONFIG, run_processes

_libc = ctypes.CDLL(None)
_libc.getenv.restype = ctypes.c_char_p


def _launch(fn, world_size=2, **options):
    return threadpar.launch(fn, config=TEST_CONFIG, world_size=world_size, **options)


def test_each_rank_sees_torchruns_variables_as_its_own():
    def body():
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
        seen = {name: os.environ.get(name) for name in names}
        seen["getenv"] = os.getenv("RANK")
        seen["C"] = _libc.getenv(b"RANK")  # C code sees the process's environment
        seen["rendezvous"] = [os.environ[n] for n in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")]
        seen["listed"] = "RANK" in dict(os.environ) and "RANK" in os.environ.copy()
        return seen

    before = os.environ.get("RANK")
    results = _launch(body, world_size=3)
    for rank, seen in enumerate(results):
        assert seen["RANK"] == seen["LOCAL_RANK"] == seen["ROLE_RANK"] == seen["getenv"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "3"
        assert seen["GROUP_RANK"] == "0" and seen["listed"]
        assert seen["C"] == (None if before is None else before.encode())
        assert seen["rendezvous"][0] == os.environ.get("MASTER_ADDR", "127.0.0.1")
    assert os.environ.get("RANK") == before and type(os.environ) is os._Environ  # the caller's, restored


def test_a_rank_writes_its_own_variables_and_the_process_writes_the_others(monkeypatch):
    monkeypatch.delenv("THREADPAR_TEST_SHARED", raising=False)

    def body():
        rank = threadpar.get_rank()
        os.environ["MASTER_PORT"] = str(40000 + rank)  # torch's test harness does this per process
        del os.environ["GROUP_RANK"]
        if rank == 0:
            os.environ["THREADPAR_TEST_SHARED"] = "set by rank 0"  # not torchrun's: shared, as threads share
        threadpar.barrier()
        return os.environ["MASTER_PORT"], "GROUP_RANK" in os.environ, os.environ.get("THREADPAR_TEST_SHARED")

    results = _launch(body)
    assert results == [("40000", False, "set by rank 0"), ("40001", False, "set by rank 0")]
    assert _libc.getenv(b"THREADPAR_TEST_SHARED") == b"set by rank 0"  # NCCL_* set in a rank reach C code
    assert os.environ.get("MASTER_PORT") != "40001"


def test_variables_across_simulated_processes_are_the_global_ranks():
    def body():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), threadpar.get_rank()

    for process in run_processes(body, 2, 2):
        for env_rank, world_size, rank in process:
            assert (env_rank, world_size) == (rank, 4)


def _reference_draws(seed: int) -> list[torch.Tensor]:
    """What one process seeded with `seed` draws: rand, nn.Linear's init, dropout, randint, normal_."""
    torch.manual_seed(seed)
    draws = [torch.rand(4), torch.nn.Linear(3, 2).weight.detach(), F.dropout(torch.ones(16), 0.5)]
    draws += [torch.randint(0, 100, (4,)), torch.empty(3).normal_(), torch.nn.Dropout(0.25)(torch.ones(8))]
    return draws


def test_manual_seed_in_a_rank_seeds_that_rank_only():
    def body():
        rank = threadpar.get_rank()
        # Seeds and draws interleaved across ranks: with one generator for the process, rank 0 would draw
        # from rank 1's seed.
        if rank == 0:
            torch.manual_seed(100)
        threadpar.barrier()
        if rank == 1:
            torch.manual_seed(101)
        threadpar.barrier()
        draws = [torch.rand(4), torch.nn.Linear(3, 2).weight.detach(), F.dropout(torch.ones(16), 0.5)]
        threadpar.barrier()
        draws += [
            torch.randint(0, 100, (4,)),
            torch.empty(3).normal_(),
            torch.nn.Dropout(0.25)(torch.ones(8)),
        ]
        return draws

    torch.manual_seed(7)
    results = _launch(body)
    after = torch.rand(2)
    for rank, draws in enumerate(results):
        for got, expected in zip(draws, _reference_draws(100 + rank)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.manual_seed(7)
    torch.testing.assert_close(after, torch.rand(2))  # the caller's generator: neither seeded nor drawn from


def test_fork_rng_and_rng_state_in_a_rank_are_the_ranks():
    def body():
        torch.manual_seed(5 + threadpar.get_rank())
        state = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            torch.rand(100)
        first = torch.rand(3)
        torch.set_rng_state(state)
        return first, torch.rand(3), torch.initial_seed()

    for rank, (first, again, seed) in enumerate(_launch(body)):
        torch.manual_seed(5 + rank)
        torch.testing.assert_close(first, torch.rand(3))
        torch.testing.assert_close(again, first)
        assert seed == 5 + rank
    assert type(torch.random.default_generator) is torch.Generator  # restored after the launch


def test_sys_exit_zero_ends_the_rank_cleanly():
    def body():
        if threadpar.get_rank() == 1:
            sys.exit(0)
        return "trained"

    assert _launch(body) == ["trained", None]


@pytest.mark.parametrize(
    ("ending", "code", "how"),
    [
        (lambda: sys.exit(3), 3, "sys.exit"),
        (lambda: sys.exit("bad data"), 1, "sys.exit"),
        (lambda: os._exit(4), 4, "os._exit"),
    ],
)
def test_a_non_zero_exit_fails_the_rank_and_names_it(ending, code, how):
    def body():
        if threadpar.get_rank() == 1:
            ending()
        threadpar.barrier()  # rank 0 waits for rank 1, which is stopped, not hung

    with pytest.raises(RankFailedError) as failed:
        _launch(body)
    assert failed.value.rank == 1 and isinstance(failed.value.error, RankExitError)
    assert failed.value.error.code == code and f"rank 1 exited with code {code} ({how})" in str(failed.value)


def test_os_exit_zero_ends_the_rank_and_os_exit_is_pythons_again_after():
    original = os._exit

    def body():
        try:
            if threadpar.get_rank() == 0:
                os._exit(0)
        except Exception:  # not caught here: os._exit is not an error
            return "caught"
        return "went on"

    assert _launch(body) == [None, "went on"]
    assert os._exit is original
