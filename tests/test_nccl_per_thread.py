"""Each rank thread calls NCCL itself (issue 32): no host meeting in a collective or a send, a rank runs ahead
of its peers, a late rank holds nobody's call; and the defects the old leader design hid, each with a test
that fails on it."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import (
    FakeCuda,
    fake_gpu_processes,
    launch_fake_gpu_processes,
    run_fake_gpu_processes,
    run_fake_gpus,
)
from fakes.sim_gpu import to_host

import threadpar
from threadpar.comm.nccl.library import data_type
from threadpar.errors import CollectiveTimeoutError, NcclError, RankFailedError

AHEAD = 100


def test_a_rank_runs_ahead_of_its_peer_through_collectives_and_point_to_point():
    issued = threading.Event()  # rank 0 has issued everything; rank 1 has not started

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        threadpar.all_reduce(torch.ones(1, device=dev))  # communicators made
        # and the pair's (the first message is a meeting)
        threadpar.send(torch.ones(1, device=dev), dst=1 - rank)
        threadpar.recv(torch.empty(1, device=dev), src=1 - rank)
        outs = [torch.full((2,), float(rank + i), device=dev) for i in range(AHEAD)]
        if rank == 1:
            assert issued.wait(60), "rank 0 waited for rank 1 inside a call"
        for t in outs:
            threadpar.all_reduce(t)  # rank 0: returns at once, the device waits for rank 1
        if rank == 0:
            for i in range(10):
                threadpar.send(torch.full((3,), float(i), device=dev), dst=1, tag=i)
            issued.set()
            return outs
        got = [threadpar.get_group().recv_tensor(0, tag=i) for i in range(10)]
        return outs, got

    outs0, (outs1, got) = to_host(run_fake_gpus(body, 2, FakeCuda(), timeout=60))
    for i, (a, b) in enumerate(zip(outs0, outs1)):
        torch.testing.assert_close(a, torch.full((2,), float(2 * i + 1)))
        torch.testing.assert_close(b, torch.full((2,), float(2 * i + 1)))
    for i, t in enumerate(got):
        torch.testing.assert_close(t, torch.full((3,), float(i)))


def test_a_late_rank_holds_no_other_ranks_call():
    on_time = threading.Barrier(3)  # ranks 0-2 meet here only if none of them waits for rank 3

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        threadpar.all_reduce(torch.ones(1, device=dev))
        t = torch.full((4,), float(rank), device=dev)
        if rank == 3:
            time.sleep(0.3)  # late
        else:
            work = threadpar.all_reduce(t, async_op=True)
            threadpar.broadcast(torch.ones(2, device=dev), src=0)
            on_time.wait(30)  # reached by all three while rank 3 has not issued anything
            work.wait()
            return t
        threadpar.all_reduce(t)
        threadpar.broadcast(torch.ones(2, device=dev), src=0)
        return t

    for t in to_host(run_fake_gpus(body, 4, FakeCuda(), timeout=60)):
        torch.testing.assert_close(t, torch.full((4,), 6.0))


def test_crossing_first_sends_and_a_ring_of_first_sends_never_wait_for_the_receivers():
    """Every rank sends to the next before it receives from the previous (ring attention's pattern): on a
    single communicator, or with a first message that waited for its receiver, that is a cycle."""

    def body():
        rank, world, dev = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
        work = threadpar.isend(torch.full((2,), float(rank), device=dev), dst=(rank + 1) % world)
        got = threadpar.get_group().recv_tensor((rank - 1) % world)
        work.wait()
        return got

    for rank, got in enumerate(to_host(run_fake_gpus(body, 4, FakeCuda(), timeout=30))):
        torch.testing.assert_close(got, torch.full((2,), float((rank - 1) % 4)))


def test_a_works_communicator_is_never_touched_after_it_was_freed():
    """Defect 1: a Work kept the raw communicator and asked NCCL for its asynchronous error after the
    launch's end had destroyed (or a stop had aborted) it: a use after free on real NCCL."""
    fakes = fake_gpu_processes(2)

    def body():
        # left for after the launch
        return threadpar.all_reduce(torch.ones(2, device=threadpar.get_device()), async_op=True)

    works = [w for per in run_fake_gpu_processes(body, fakes, 1) for w in per]
    assert sum(len(f.nccl.destroyed) for f in fakes) == 2  # the launch's end destroyed the communicators
    for work in works:
        assert work.is_completed()
        work.wait()
        work.synchronize()
    assert not any(f.nccl.violations for f in fakes)


def test_two_spanning_groups_of_the_same_ranks_have_communicators_of_their_own():
    """Defect 2: new_group(ranks, timeout=...) is another group of the same ranks, but it shared the first's
    store keys: its members read the first group's spent unique id."""

    def body():
        first = threadpar.new_group([0, 2])
        second = threadpar.new_group([0, 2], timeout=datetime.timedelta(seconds=20))
        if not first.is_member():
            return None
        dev = threadpar.get_device()
        a, b = torch.ones(2, device=dev), torch.full((2,), 3.0, device=dev)
        first.all_reduce(a)
        second.all_reduce(b)
        return a, b

    outcomes = run_fake_gpu_processes(body, fake_gpu_processes(2), 2, timeout=20)
    results = [to_host(r) for per in outcomes for r in per]
    for a, b in (results[0], results[2]):
        torch.testing.assert_close(a, torch.full((2,), 2.0))
        torch.testing.assert_close(b, torch.full((2,), 6.0))


def test_every_communicator_is_destroyed_or_pooled_when_the_launch_ends():
    """Defect 3: ncclCommDestroy was never called (pair and spanning communicators leaked device memory)."""
    fake = FakeCuda()

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        threadpar.all_reduce(torch.ones(1, device=dev))
        threadpar.send(torch.ones(1, device=dev), dst=1 - rank)
        threadpar.recv(torch.empty(1, device=dev), src=1 - rank)

    run_fake_gpus(body, 2, fake)
    made = {(c.uid, c.rank) for c in fake.nccl.init_calls}
    destroyed = {(c.uid, c.rank) for c in fake.nccl.destroyed}
    pooled = {(c.raw.uid, c.raw.rank) for c in fake.cliques.drain()}
    assert len(made) == 2 + 4 and len(pooled) == 2  # the WORLD clique kept for the next launch
    assert destroyed == made - pooled  # the pairs' four communicators destroyed


def test_nccl_data_types_follow_the_header_of_the_running_version():
    """Defect 4: fp8 appeared in nccl.h in 2.24.3 (absent in 2.23.4), not 2.19; uint32/uint64 are NCCL's
    types 3 and 5."""
    assert data_type(torch.uint32) == 3 and data_type(torch.uint64) == 5
    assert data_type(torch.float8_e4m3fn, (2, 24, 3)) == 10
    with pytest.raises(NcclError, match=r"no data type for torch\.float8_e4m3fn"):
        data_type(torch.float8_e4m3fn, (2, 23, 4))


def test_a_stop_does_not_wait_for_a_rank_inside_a_slow_nccl_call():
    """Defect 5: the stop's waker aborted the communicators itself, so a stop could wait behind a thread
    holding the launch lock inside NCCL; now the stop only wakes the watchdog, which aborts."""
    fake = FakeCuda()
    fake.nccl.init_seconds = 20  # the communicators' creation takes (on the connectors, device locks held)

    def body():
        if threadpar.get_rank() == 1:
            time.sleep(0.2)
            raise ValueError("rank 1 fails while rank 0 is inside ncclCommInitRank")
        threadpar.all_reduce(torch.ones(1, device=threadpar.get_device()))

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 fails"):
        run_fake_gpus(body, 2, fake, timeout=60)
    assert time.monotonic() - start < 15  # (the init lasts 20 s: the stop did not wait for it)


def test_a_process_that_dies_inside_the_creation_is_named_instead_of_hanging():
    """Defect 5: a blocking ncclCommInitRank has no timeout; a process lost after the processes agreed hung
    the others in it. The creation now runs on a connector the member waits for, bounded."""
    fakes = fake_gpu_processes(2)
    fakes[1].nccl.init_stall = 60  # process 1 agrees, then never joins the communicators' creation

    def body():
        threadpar.all_reduce(torch.ones(1, device=threadpar.get_device()))

    outcomes = launch_fake_gpu_processes(body, fakes, 1, timeout=1.0)
    assert all(isinstance(outcome, RankFailedError) for outcome in outcomes)  # both stop, neither hangs
    # (whichever process gave up first is the root cause both report)
    assert "waited 1 s inside NCCL for its peers to create or connect their communicators" in str(outcomes[0])


def test_a_launch_that_ends_with_an_operation_its_peer_never_issued_says_so_instead_of_hanging():
    """ncclCommDestroy waits for the communicator's operations: one whose peer never issued its part would
    hang the end of the launch. The end waits for the device at most the timeout, then names the call."""

    def body():
        dev = threadpar.get_device()
        threadpar.all_reduce(torch.ones(1, device=dev))
        if threadpar.get_rank() == 0:
            threadpar.all_reduce(torch.ones(1, device=dev))  # rank 1 returns without it

    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[1\] never issued all_reduce.*#2.*aborted"):
        run_fake_gpus(body, 2, FakeCuda(), timeout=0.5)
