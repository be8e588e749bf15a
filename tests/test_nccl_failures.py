"""The nccl backend's failures on the test double: NCCL errors, device hangs, asynchronous errors, mismatches,
missing ranks. Each must reach every affected rank as a clear exception, never a hang."""

import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError, NcclError


def test_an_nccl_call_that_fails_raises_ncclerror_on_every_member():
    fake = FakeCuda()
    fake.nccl.fail_next["ncclAllReduce"] = "unhandled cuda error"

    def body():
        with pytest.raises(NcclError) as info:
            threadpar.all_reduce(torch.ones(2))
        return str(info.value)

    for message in run_fake_gpus(body, 3, fake):
        assert "all_reduce(float32[2], op=SUM) #1 on group 'WORLD' failed" in message
        assert (
            "NCCL all_reduce on group 'WORLD' failed: ncclAllReduce failed: ncclInternalError (unhandled cuda error)"
            in message
        )


def test_synchronize_and_wait_with_timeout_fail_clearly_when_the_device_hangs():
    fake = FakeCuda()

    def body():
        work = threadpar.broadcast(torch.ones(2), src=0, async_op=True)
        start = time.monotonic()
        with pytest.raises(
            CollectiveTimeoutError, match=r"broadcast.*was launched but the device did not finish"
        ):
            work.synchronize()  # the launch's timeout (0.3 s)
        with pytest.raises(CollectiveTimeoutError, match=r"within 0\.1 s"):
            work.wait(timeout=0.1)
        assert not work.is_completed()
        return time.monotonic() - start

    fake.hang()
    # The exceptions above are the check; this bound only says "gave up after the 0.3 s timeout, did not hang":
    # 100x the timeout, far from what a busy machine adds, and below pytest-timeout's 60 s so it fails clearly.
    assert all(elapsed < 30 for elapsed in run_fake_gpus(body, 2, fake, timeout=0.3))


def test_an_asynchronous_nccl_error_ends_a_blocking_wait_at_once():
    fake = FakeCuda()

    def body():
        work = threadpar.all_reduce(torch.ones(2), async_op=True)
        threadpar.barrier()
        if threadpar.get_rank() == 0:
            fake.async_error_message = "NCCL error 6: remote process exited or there was a network error"
        threadpar.barrier()
        start = time.monotonic()
        # The device hangs, so only the asynchronous error can end this wait with an NcclError (its 30 s
        # timeout would raise CollectiveTimeoutError): the type is the check. The bound (half the timeout) is
        # wide on purpose; the poll that notices the error runs every few milliseconds.
        with pytest.raises(
            NcclError, match=r"all_reduce.*failed on the device: NCCL error 6: remote process"
        ):
            work.wait(timeout=30)
        assert time.monotonic() - start < 15
        assert work.is_completed() and not work.is_success()
        with pytest.raises(NcclError):
            work.wait()  # the failure sticks to the Work

    fake.hang()
    run_fake_gpus(body, 2, fake)


def test_a_cuda_error_seen_by_the_done_event_becomes_an_ncclerror():
    fake = FakeCuda()

    def body():
        work = threadpar.all_reduce(torch.ones(2), async_op=True)
        threadpar.barrier()
        if threadpar.get_rank() == 0:
            fake.device_error = "an illegal memory access was encountered"
        threadpar.barrier()
        with pytest.raises(NcclError, match=r"failed on the device: CUDA error: an illegal memory access"):
            work.synchronize()

    run_fake_gpus(body, 2, fake)


def test_mismatched_collectives_raise_on_every_member():
    def body():
        t = torch.zeros(4)
        threadpar.all_reduce(t)  # the communicators exist: the next call meets at the rendezvous only
        with pytest.raises(
            CollectiveMismatchError, match=r"rank 1: broadcast\(float32\[4\], src=0\)   <-- differs"
        ):
            if threadpar.get_rank() == 1:
                threadpar.broadcast(t, src=0)
            else:
                threadpar.all_reduce(t)

    run_fake_gpus(body, 3, FakeCuda())


def test_a_rank_that_does_not_come_times_out_naming_it():
    timed_out = threading.Event()  # rank 1 stays away until rank 0 has timed out

    def body():
        if threadpar.get_rank() == 0:
            threadpar.barrier()
            with pytest.raises(CollectiveTimeoutError, match=r"all_reduce.*ranks \[1\] did not arrive"):
                threadpar.all_reduce(torch.ones(1))
            timed_out.set()
        else:
            threadpar.barrier()
            assert timed_out.wait(timeout=30)

    run_fake_gpus(body, 2, FakeCuda(), timeout=0.3)


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


def test_a_clique_some_member_never_completed_is_not_pooled():
    from threadpar.comm.nccl.cuda_api import CliquePool

    pool = CliquePool()
    pool.give_back(("cuda:0", "cuda:1"), ["comm0", None])
    assert pool.take(("cuda:0", "cuda:1")) is None
    pool.give_back(("cuda:0", "cuda:1"), ["comm0", "comm1"])
    assert pool.take(("cuda:1", "cuda:0")) is None  # another device order is another clique
    assert pool.take(("cuda:0", "cuda:1")) == ["comm0", "comm1"]


@pytest.mark.parametrize("trouble", ["clean", "async_error", "timeout", "nccl_error", "abort"])
def test_communicators_of_a_group_in_trouble_are_never_given_to_a_later_launch(trouble):
    # torch cannot abort or destroy a communicator (torch/csrc/cuda/python_nccl.cpp: destroy_nccl_comm
    # returns before ncclCommDestroy), and one that saw an error or a hang may hold half-done work:
    # a later launch on the same devices must make new ones.
    import gc

    fake = FakeCuda()

    def first():
        threadpar.all_reduce(torch.ones(2))  # creates the clique
        if trouble == "async_error":
            work = threadpar.all_reduce(torch.ones(2), async_op=True)
            threadpar.barrier()
            if threadpar.get_rank() == 0:
                fake.async_error_message = "NCCL error 6: remote process exited"
            threadpar.barrier()
            with pytest.raises(NcclError):
                work.wait(timeout=5)
        elif trouble == "timeout":
            threadpar.barrier()
            if threadpar.get_rank() == 0:
                fake.hang()
            threadpar.barrier()
            work = threadpar.all_reduce(torch.ones(2), async_op=True)
            with pytest.raises(CollectiveTimeoutError):
                work.wait(timeout=0.05)
        elif trouble == "nccl_error":
            if threadpar.get_rank() == 0:
                fake.nccl.fail_next["ncclAllReduce"] = "unhandled cuda error"
            threadpar.barrier()
            with pytest.raises(NcclError):
                threadpar.all_reduce(torch.ones(2))
        elif trouble == "abort" and threadpar.get_rank() == 1:
            raise ValueError("a rank fails after its collective")

    if trouble == "abort":
        with pytest.raises(ValueError):
            run_fake_gpus(first, 2, fake)
    else:
        run_fake_gpus(first, 2, fake)
    fake.resume()
    fake.async_error_message = None
    gc.collect()  # the first launch's groups are gone: a clean clique is back in the pool
    run_fake_gpus(lambda: threadpar.all_reduce(torch.ones(2)), 2, fake)
    uids = [c.comms[0].uid for c in fake.calls_named("all_reduce")]
    if trouble == "clean":
        assert len(fake.nccl.init_calls) == 2 and uids[-1] == uids[0]  # reused
    else:
        assert len(fake.nccl.init_calls) == 4 and uids[-1] != uids[0], f"{trouble}: communicators reused"
