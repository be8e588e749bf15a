"""Point to point at the cost of one process per GPU (issue 39), on the double: no thread sleeps or polls with a
device lock held, a synchronous send makes no device copy, pipelines and ring attention hold no communicator
beyond their group's, and NCCL's memory is counted."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.fake_nccl_memory import NcclMemoryModel
from fakes.sim_gpu import to_host
from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks
from torch.utils._python_dispatch import TorchDispatchMode

import threadpar
from threadpar.comm.nccl.resources import DeviceLocks
from threadpar.pipeline import PipelineParallel


class _TimedLock:
    """A device lock that remembers the longest time it was held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        self.longest = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._since = time.monotonic()
        return got

    def release(self) -> None:
        self.longest = max(self.longest, time.monotonic() - self._since)
        self._lock.release()

    def __enter__(self) -> _TimedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _TimedLocks(DeviceLocks):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[_TimedLock] = []

    def lock(self, device):  # type: ignore[override]
        with self._lock:
            if device not in self._locks:
                timed = _TimedLock()
                self.made.append(timed)
                self._locks[device] = timed  # type: ignore[assignment]
            return self._locks[device]


def made(rank: int) -> None:
    """Ranks 0 and 1 exchange a message each way: their pair's communicators exist on both sides after it (a
    receive waits for its side's)."""
    x = torch.zeros(1, device=threadpar.get_device())
    if rank == 0:
        threadpar.send(x, dst=1)
        threadpar.recv(x, src=1)
    else:
        threadpar.recv(x, src=0)
        threadpar.send(x, dst=0)


def test_a_nonblocking_launch_is_waited_for_without_the_device_lock():
    """From NCCL 2.23 every group end on a nonblocking communicator (the pairs' of point to point) returns
    ncclInProgress while a thread of NCCL's launches it (src/group.cc); whoever waits for it must not hold
    its device's lock meanwhile (the device's other threads would wait behind NCCL's launch thread)."""
    fake = FakeCuda()
    fake.device_locks = _TimedLocks()
    launch_s = 0.6

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        t = torch.ones(4, device=dev)
        made(rank)
        if rank == 0:
            fake.nccl.nonblocking_launch_s = launch_s
            began = time.monotonic()
            threadpar.send(t, dst=1)
            return time.monotonic() - began
        threadpar.recv(torch.empty(4, device=dev), src=0)
        return None

    took = run_fake_gpus(body, 2, fake)[0]
    assert took >= launch_s  # the send waited for NCCL's launch thread, as it must before using its stream
    longest = max(lock.longest for lock in fake.device_locks.made)
    assert longest < launch_s / 2, f"a device lock was held {longest:.3f} s while NCCL's launch thread ran"


class _Copies(TorchDispatchMode):
    """Counts the device copies made on this thread (a clone, a copy_, a contiguous)."""

    COPIES = frozenset({"aten.clone.default", "aten.copy_.default", "aten._to_copy.default"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.COPIES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_synchronous_send_makes_no_device_copy():
    """Stream order protects a sent tensor (the caller's stream waits for the ncclSend), as torch's send;
    only the first message of a pair, sent while its communicators are being made, is a snapshot."""

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        made(rank)
        if rank == 0:
            t = torch.arange(4.0, device=dev)
            with _Copies() as copies:
                for _ in range(3):
                    threadpar.send(t, dst=1)
            t.fill_(-1.0)  # after the sends, in stream order: the messages are the values sent
            return copies.count
        got = []
        for _ in range(3):
            x = torch.empty(4, device=dev)
            threadpar.recv(x, src=0)
            got.append(x)
        return to_host(got)

    copies, got = run_fake_gpus(body, 2, FakeCuda())
    assert copies == 0
    for x in got:
        torch.testing.assert_close(x, torch.arange(4.0))


@pytest.mark.parametrize("async_op", [False, True])
def test_a_sent_tensor_overwritten_in_stream_order_arrives_as_it_was(async_op):
    """The double runs the send only when the receiver posts (lazy): the overwrite must wait for it."""

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        t = torch.full((3,), 7.0, device=dev)
        made(rank)
        if rank == 0:
            work = threadpar.isend(t, dst=1) if async_op else threadpar.send(t, dst=1)
            if work is not None:
                work.wait()
            t.add_(1.0)
            return None
        time.sleep(0.05)  # posted late
        x = torch.empty(3, device=dev)
        threadpar.recv(x, src=0)
        return to_host(x)

    torch.testing.assert_close(run_fake_gpus(body, 2, FakeCuda(lazy=True))[1], torch.full((3,), 7.0))


def test_a_stage_holds_one_communicator_and_no_pair_of_its_own():
    """pp = 4: each stage's only communicator is the PP group's (before: four pair communicators more on an
    inner stage, each with its own ring buffers); NCCL's memory on each GPU is that communicator's collectives
    and the point-to-point buffers of its neighbours."""
    fake = FakeCuda()
    inputs, targets = make_batch(8)

    def body():
        dev = threadpar.get_device()
        pipe = PipelineParallel(my_chunks(make_model(4).to(dev), 1), loss_fn=lm_loss, num_microbatches=4)
        pipe.train_step(inputs.to(dev), targets.to(dev))
        gpu = threadpar.get_rank()  # (the double's GPUs are numbered by rank)
        return len(fake.nccl.live_communicators(gpu)), fake.nccl.device_bytes(gpu)

    model = NcclMemoryModel()
    for stage, (comms, nbytes) in enumerate(run_fake_gpus(body, 4, fake, pp=4)):
        assert comms == 1
        receives_from = 2 if stage in (1, 2) else 1  # its neighbours only: activations and gradients
        assert nbytes == model.collectives(4) + receives_from * model.peer()


def test_ring_attention_holds_the_context_parallel_communicator_only():
    from threadpar.parallel import ring_attention

    fake = FakeCuda()

    def body():
        g, dev = torch.Generator().manual_seed(threadpar.get_rank()), threadpar.get_device()
        q, k, v = (torch.randn(1, 2, 4, 8, generator=g).to(dev).requires_grad_() for _ in range(3))
        ring_attention(q, k, v, causal=True).sum().backward()
        gpu = threadpar.get_rank()
        return len(fake.nccl.live_communicators(gpu))

    assert run_fake_gpus(body, 4, fake, cp=4) == [1, 1, 1, 1]


def test_the_pool_holds_a_bounded_number_of_cliques_and_is_drained_at_exit():
    """A pooled clique keeps all of its NCCL buffers: the pool lets go of its oldest past `total`, and the
    process's pool is destroyed at exit (release_pooled, registered with atexit by the real runtime)."""
    from threadpar.comm.nccl.cuda_api import release_pooled
    from threadpar.comm.nccl.resources import CliquePool

    pool = CliquePool(per_key=2, total=3)
    assert pool.put(("0", "1"), ["a0", "a1"]) == []
    assert pool.put(("2", "3"), ["b2", "b3"]) == []
    assert pool.put(("0", "1"), ["c0", "c1"]) == []
    assert pool.put(("4", "5"), ["d4", "d5"]) == ["a0", "a1"]  # the oldest goes
    assert len(pool) == 3 and pool.take(("0", "1")) == ["c0", "c1"]
    assert len(pool) == 2

    fake = FakeCuda()

    def body():
        threadpar.all_reduce(torch.ones(1, device=threadpar.get_device()))

    run_fake_gpus(body, 2, fake)  # a clean launch: its clique goes to the pool
    assert len(fake.cliques) == 1 and len(fake.nccl.live_communicators(0)) == 1
    assert release_pooled(fake.cliques) == 2
    assert fake.nccl.live_communicators(0) == [] and fake.nccl.live_communicators(1) == []
    assert len(fake.nccl.destroyed) == 2 and not fake.nccl.violations
