"""LaunchConfig.rank_cores: which cores a process's rank threads run on (threadpar.runtime.rank_cores)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import threadpar
from threadpar.comm.common.work import Work
from threadpar.errors import ConfigError
from threadpar.runtime import context, rank_cores
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.rank_cores import choose_rank_cpus, current_cpu
from threadpar.testing import run_ranks

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")


def choose(setting, *, on_cpu=True, threads=8, local_index=0, local_count=1, allowed=(0, 1), current=None):
    return choose_rank_cpus(
        setting,
        on_cpu=on_cpu,
        threads=threads,
        local_index=local_index,
        local_count=local_count,
        allowed=list(allowed),
        current=current,
    )


@pytest.fixture
def with_the_gil(monkeypatch):
    """The GIL on, as on every GIL build (a free-threaded build running this suite has it off)."""
    monkeypatch.setattr(rank_cores, "gil_enabled", lambda: True)


@linux_only
def test_auto_packs_cpu_ranks_onto_one_core_and_leaves_gpus_and_lone_ranks_alone(with_the_gil):
    assert choose(None) == frozenset({0})
    assert choose(None, current=1) == frozenset({1})  # a lone process: the launching thread's core
    assert choose(None, on_cpu=False) is None
    assert choose(None, threads=1) is None  # one rank thread: no GIL to share
    assert choose(None, allowed=(3,)) is None  # one core allowed anyway


@linux_only
def test_auto_leaves_ranks_unpinned_without_a_gil(monkeypatch):
    """Free-threaded CPython with the GIL off: no convoy to avoid, and one core would serialise the ranks'
    Python (benchmarks/free_threading.py --demo)."""
    monkeypatch.setattr(rank_cores, "gil_enabled", lambda: False)
    assert choose(None) is None
    assert choose(1) == frozenset({0})  # an explicit setting is kept


@linux_only
def test_processes_of_a_node_take_different_cores(with_the_gil):
    cores = tuple(range(8))
    got = [choose(None, local_index=i, local_count=4, allowed=cores, current=5) for i in range(4)]
    assert got == [frozenset({i}) for i in range(4)]
    got = [choose(2, local_index=i, local_count=4, allowed=cores) for i in range(4)]
    assert got == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}), frozenset({6, 7})]


@linux_only
def test_all_and_every_allowed_core_leave_the_ranks_unpinned():
    assert choose("all") is None
    assert choose(2, allowed=(0, 1)) is None


@linux_only
def test_more_cores_than_the_process_may_use_is_a_config_error_saying_how_many():
    with pytest.raises(
        ConfigError, match=r"rank_cores=3 but this process may use 2 core\(s\); pass at most 2"
    ):
        choose(3)
    with pytest.raises(ConfigError, match=r"may use 1 core\(s\) \(2 cores for 2 processes on this node\)"):
        choose(2, local_count=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "one", "ALL"])
def test_a_bad_setting_fails_when_the_config_is_built(bad):
    with pytest.raises(ConfigError, match="rank_cores must be a positive int"):
        LaunchConfig(rank_cores=bad)


def test_current_cpu_is_one_the_thread_may_run_on():
    cpu = current_cpu()
    if cpu is None:
        pytest.skip("no /proc/thread-self/stat here")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {cpu}
    assert cpu in allowed


def _cores_and_threads():
    """(this rank's cores, its comm worker's cores, its torch threads)."""
    group = threadpar.get_group()
    seen: list[set[int]] = []
    done = threading.Event()

    # An async collective starts the rank's comm worker, which enters the rank's context on its thread.
    work = group.all_reduce(torch.ones(1), async_op=True)
    work.wait()
    ctx = context.current()
    ctx.worker.submit(
        lambda: (seen.append(os.sched_getaffinity(0)), done.set()), Work("probe", ctx.world.abort)
    )
    done.wait(30)
    return sorted(os.sched_getaffinity(0)), sorted(seen[0]), torch.get_num_threads()


@linux_only
def test_rank_threads_and_their_comm_workers_run_on_the_chosen_cores_and_the_caller_is_untouched(
    with_the_gil,
):
    before = os.sched_getaffinity(0)
    allowed = sorted(before)
    results = run_ranks(_cores_and_threads, 2)
    first = results[0][0]
    if len(allowed) == 1:
        assert first == allowed
    else:
        assert len(first) == 1 and first[0] in allowed
    assert results == [(first, first, 1)] * 2  # every rank, and its worker, on the same one core
    assert os.sched_getaffinity(0) == before
    unpinned = run_ranks(_cores_and_threads, 2, rank_cores="all")
    assert [r[:2] for r in unpinned] == [(allowed, allowed)] * 2
