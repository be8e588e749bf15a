"""The nccl backend's failures on the test double: NCCL errors, device hangs, asynchronous errors, mismatches,
missing ranks, stopped launches. Each must stop the launch with a clear exception naming the rank (found by
the rank itself or by the process's watchdog), never a hang; communicators of a failed launch are aborted."""

import re
import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar.comm.nccl.resources import CliquePool
from threadpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError, NcclError


def ones(n: int) -> torch.Tensor:
    """n ones on the calling rank's device (the double's GPU)."""
    return torch.ones(n, device=threadpar.get_device())


def test_an_nccl_call_that_fails_stops_the_launch_naming_the_call():
    fake = FakeCuda()

    def body():
        threadpar.all_reduce(ones(2))  # the communicators exist
        threadpar.barrier()
        if threadpar.get_rank() == 1:
            fake.nccl.fail_next["ncclBroadcast"] = "unhandled cuda error"
        together.wait()
        threadpar.broadcast(ones(2), src=0)  # one rank's call fails; the other's waits until aborted
        while True:
            time.sleep(0.01)

    together = threading.Barrier(2)
    with pytest.raises(NcclError) as info:
        run_fake_gpus(body, 2, fake)
    message = str(info.value)
    assert re.search(r"broadcast\(float32\[2\], src=0\) #3 on group 'WORLD' \(rank \d\) failed", message), (
        message
    )
    assert "ncclBroadcast failed: ncclInternalError (unhandled cuda error)" in message
    assert len(fake.nccl.aborted) == 2  # the launch stopped: both communicators aborted


def test_a_wait_with_a_timeout_gives_up_clearly_while_the_device_hangs():
    fake = FakeCuda()
    together = threading.Barrier(2)

    def body():
        threadpar.all_reduce(ones(2))
        together.wait()
        if threadpar.get_rank() == 0:
            fake.hang()
        together.wait()
        work = threadpar.broadcast(ones(2), src=0, async_op=True)
        with pytest.raises(
            CollectiveTimeoutError, match=r"broadcast.*timed out after 0\.1 s waiting for the device"
        ):
            work.wait(timeout=0.1)
        assert not work.is_completed()
        together.wait()
        if threadpar.get_rank() == 0:
            fake.resume()
        work.wait(timeout=10)  # now it runs

    run_fake_gpus(body, 2, fake, timeout=30)


def test_a_device_that_hangs_is_found_by_the_watchdog_which_names_the_rank_and_group():
    fake = FakeCuda()
    together = threading.Barrier(2)

    def body():
        threadpar.all_reduce(ones(2))
        together.wait()
        if threadpar.get_rank() == 0:
            fake.hang()
        together.wait()
        threadpar.all_reduce(ones(2))  # returns: the device waits (for ever)
        while True:  # the rank goes on with host work until the launch stops it
            time.sleep(0.01)

    start = time.monotonic()
    with pytest.raises(
        CollectiveTimeoutError,
        match=r"the device has not finished the NCCL operations rank \d issued on group 'WORLD'",
    ):
        run_fake_gpus(body, 2, fake, timeout=0.5)
    # The exception is the check; this bound only says "stopped near the timeout, did not hang": 60x it.
    assert time.monotonic() - start < 30
    assert len(fake.nccl.aborted) == 2
    fake.resume()


def test_an_asynchronous_nccl_error_stops_the_launch():
    fake = FakeCuda()

    def body():
        threadpar.all_reduce(ones(2))
        threadpar.barrier()
        if threadpar.get_rank() == 0:
            fake.nccl.async_error_code = 6  # ncclRemoteError, as a peer process's loss reports it
        while True:
            time.sleep(0.01)

    with pytest.raises(
        NcclError, match=r"NCCL error 6: remote process exited"
    ):  # (the watchdog's or a wait's)
        run_fake_gpus(body, 2, fake, timeout=30)


def test_a_cuda_error_seen_by_a_done_event_becomes_an_ncclerror():
    fake = FakeCuda()

    def body():
        work = threadpar.all_reduce(ones(2), async_op=True)
        threadpar.barrier()
        if threadpar.get_rank() == 0:
            fake.device_error = "an illegal memory access was encountered"
        work.synchronize()

    with pytest.raises(NcclError, match=r"CUDA error: an illegal memory access"):
        run_fake_gpus(body, 2, fake)


def test_a_mismatched_call_is_named_by_its_rank_which_never_issues_it():
    """The minority is named whatever the order (comm/common/mismatch.py); who never issues its call depends on
    it: a member that finds its call differs raises before NCCL sees it, while a slot's first entrant issues at
    once (comm/common/call_ledger.py). So rank 1 comes after rank 0 has issued, and NCCL never sees its call."""
    fake = FakeCuda()
    issued = threading.Event()

    def body():
        t = torch.zeros(4, device=threadpar.get_device())
        threadpar.all_reduce(t)  # the communicators exist: the next calls meet nowhere
        if threadpar.get_rank() == 1:
            assert issued.wait(30)
            threadpar.broadcast(t, src=0)
        else:
            threadpar.all_reduce(t)  # returns once issued: the device waits for the peers
            if threadpar.get_rank() == 0:
                issued.set()
        while True:  # the launch's stop ends this
            time.sleep(0.01)

    with pytest.raises(
        CollectiveMismatchError, match=r"rank 1: broadcast\(float32\[4\], src=0\)   <-- differs"
    ):
        run_fake_gpus(body, 3, fake)
    assert fake.calls_of("broadcast", rank=1) == []  # (NCCL never saw the mismatched call)


def test_a_rank_that_does_not_come_is_named_by_the_watchdog():
    def body():
        threadpar.all_reduce(ones(1))
        if threadpar.get_rank() == 0:
            threadpar.all_reduce(ones(1))  # rank 1 never issues it
        while True:
            time.sleep(0.01)

    with pytest.raises(
        CollectiveTimeoutError, match=r"all_reduce.*#2 on group 'WORLD'.*ranks \[1\] did not issue it"
    ):
        run_fake_gpus(body, 2, FakeCuda(), timeout=0.3)


def test_the_watchdog_names_a_late_rank_while_a_thread_holds_its_device_lock_in_nccl():
    """A connector inside a blocking NCCL call that waits for a peer holds its device's lock, for ever if the
    peer's process died (issue 37, item 3). The watchdog, the process's one, must not wait with it: it looks at
    that device on a later tick, and meanwhile still names the rank that never issued its call."""
    fake, stuck, released, held_out = FakeCuda(), threading.Event(), threading.Event(), []

    def hold() -> None:  # (the stuck connector)
        with fake.device_locks.lock(0):
            stuck.set()
            if not released.wait(20):
                held_out.append(True)

    def body():
        threadpar.all_reduce(ones(1))  # (the communicators exist)
        if threadpar.get_rank() == 1:
            assert stuck.wait(10)
            threadpar.all_reduce(ones(1))  # rank 0 never issues it
        else:
            threading.Thread(target=hold, daemon=True).start()
            try:
                while True:  # the launch's stop ends this
                    time.sleep(0.01)
            finally:
                released.set()

    with pytest.raises(CollectiveTimeoutError, match=r"all_reduce.*#2 on group 'WORLD'.*ranks \[0\] did not"):
        run_fake_gpus(body, 2, fake, timeout=0.5)
    assert not held_out  # (named while the lock was held, not after the holder gave up)


def test_nccl_on_a_torch_without_nccl_says_so():
    from threadpar.runtime.world import World

    world = World(
        layout=threadpar.Layout.build(2),
        backend="nccl",
        devices=(torch.device("cuda", 0), torch.device("cuda", 1)),
        timeout=1.0,
        seed=0,
        intraop_threads=1,
    )
    if world.nccl_runtime().nccl_available():
        pytest.skip("this torch has NCCL")
    with pytest.raises(ConfigError, match=r"NCCL cannot run here.*THREADPAR_NCCL_LIBRARY.*backend='threads'"):
        world.world_group()


def test_the_pool_keeps_a_few_cliques_per_device_set_and_hands_the_rest_back():
    pool = CliquePool(per_key=1)
    assert pool.put(("0", "1"), ["a0", "a1"]) == []
    assert pool.put(("0", "1"), ["b0", "b1"]) == ["b0", "b1"]  # full: the caller destroys these
    assert pool.take(("1", "0")) is None  # another device order is another clique
    assert pool.take(("0", "1")) == ["a0", "a1"]
    assert pool.drain() == []


@pytest.mark.parametrize("trouble", ["clean", "async_error", "nccl_error", "abort"])
def test_communicators_of_a_launch_in_trouble_are_aborted_never_pooled(trouble):
    fake = FakeCuda()

    def first():
        threadpar.all_reduce(ones(2))  # creates the clique
        threadpar.barrier()
        if trouble == "async_error":
            if threadpar.get_rank() == 0:
                fake.nccl.async_error_code = 6
            while True:
                time.sleep(0.01)
        elif trouble == "nccl_error":
            if threadpar.get_rank() == 0:
                fake.nccl.fail_next["ncclAllReduce"] = "unhandled cuda error"
            threadpar.barrier()
            threadpar.all_reduce(ones(2))
        elif trouble == "abort" and threadpar.get_rank() == 1:
            raise ValueError("a rank fails after its collective")

    if trouble == "clean":
        run_fake_gpus(first, 2, fake)
    else:
        with pytest.raises((NcclError, ValueError)):
            run_fake_gpus(first, 2, fake, timeout=30)
    fake.nccl.async_error_code = 0
    run_fake_gpus(lambda: threadpar.all_reduce(ones(2)), 2, fake)
    if trouble == "clean":
        assert len(fake.nccl.init_calls) == 2 and not fake.nccl.aborted  # reused from the pool
    else:
        assert len(fake.nccl.init_calls) == 4, f"{trouble}: communicators reused"
        assert len(fake.nccl.aborted) == 2  # the first launch's, at its end
