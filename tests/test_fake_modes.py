"""The CUDA/NCCL double's device catches what a GPU would (tests/fakes/fake_device.py): a collective runs on
its stream only once every rank's part is there, and an op on one of its buffers (computed on the host here)
waits for it when the op's stream is ordered after it, or is a race when not, inside a backward too; a read
on the host (tolist) is a device-to-host copy that waits for the stream; NCCL's in-place offset rule for
all-gather and reduce-scatter; backward on a device thread without the rank's context. (The weak logs are
checked by test_payload_lifetime.py.)"""

import threading

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.fake_device_index import bound_to
from test_nccl_double import clique, stream

import threadpar
from threadpar import ReduceOp
from threadpar.comm.nccl.library import SUM, nccl_group
from threadpar.errors import NotInRankError
from threadpar.runtime.context import in_rank


def test_a_collective_runs_only_once_every_rank_issued_it_and_the_host_waits_where_the_stream_would():
    rank_0_read = threading.Event()

    def body():
        dev = threadpar.get_device()
        threadpar.all_reduce(torch.ones(1, device=dev))  # (the communicators exist from here on)
        t = torch.ones(4, device=dev)
        if threadpar.get_rank() == 1:
            assert rank_0_read.wait(30)
        threadpar.all_reduce(t, ReduceOp.SUM)  # synchronous: on this rank's current stream
        if threadpar.get_rank() == 0:
            threading.Timer(0.2, rank_0_read.set).start()  # rank 1 issues its part only after this
        # an op on the result, on the current stream: the double computes it on the host, which waits until rank
        # 1's part is there and the collective ran, as the stream would
        after = t * 1
        listed = t.tolist()  # a device-to-host copy: the host waits for the stream
        return after, listed

    for after, listed in sim_gpu.to_host(run_fake_gpus(body, 2, FakeCuda())):
        assert torch.equal(after, torch.full((4,), 2.0)) and listed == [2.0] * 4


@pytest.mark.parametrize("which", ["input", "output"])
def test_a_buffer_touched_before_waiting_on_the_work_is_a_race(which):
    fake = FakeCuda(lazy=True)  # (the latest schedule: the collective has not run when the buffer is touched)
    both_issued = threading.Barrier(2)

    def body():
        dev = threadpar.get_device()
        src, out = torch.ones(4, device=dev), torch.empty(8, device=dev)
        work = threadpar.get_group().all_gather_into_tensor(out, src, async_op=True)  # on the comm stream
        both_issued.wait()
        if which == "input":
            src.add_(1)  # a write to what the collective reads, before the stream waited on it
        else:
            out.sum()  # a read of what it writes
        work.wait()

    with pytest.raises(
        RuntimeError, match=f"race: aten::.* {'writes' if which == 'input' else 'reads'} a buffer"
    ):
        run_fake_gpus(body, 2, fake)
    assert fake.races


def test_a_race_found_inside_a_backward_reaches_its_caller():
    """A node's backward reading a buffer an unwaited collective writes: the race is raised by the op the engine
    runs, through its stream guards, and backward() raises it (the double's guard is Python: sim_gpu_engine.py)."""
    fake = FakeCuda(lazy=True)
    both_issued = threading.Barrier(2)

    def body():
        dev = threadpar.get_device()
        w, out = torch.nn.Parameter(torch.ones(4, device=dev)), torch.empty(8, device=dev)
        loss = (w * out[:4]).sum()  # (its backward reads out: w's gradient is out[:4])
        work = threadpar.get_group().all_gather_into_tensor(out, torch.ones(4, device=dev), async_op=True)
        both_issued.wait()
        try:
            loss.backward()
        finally:
            work.wait()

    with pytest.raises(RuntimeError, match=r"race: aten::mul\.Tensor reads a buffer that all_gather"):
        run_fake_gpus(body, 2, fake)
    assert fake.races


def test_after_waiting_on_the_work_the_buffer_is_the_callers():
    def body():
        dev = threadpar.get_device()
        out = torch.empty(2, device=dev)
        work = threadpar.get_group().all_gather_into_tensor(out, torch.ones(1, device=dev), async_op=True)
        work.wait()  # the current stream waits: a host op there is ordered after the collective
        return out.sum()

    fake = FakeCuda()
    assert [s.item() for s in run_fake_gpus(body, 2, fake)] == [2.0, 2.0]
    assert not fake.races


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("offset", [0, 1], ids=["rank-offset", "wrong-offset"])
def test_nccls_in_place_offset_rule(op, offset, monkeypatch):
    """ncclAllGather(data + rank * count, data) and ncclReduceScatter(data, data + rank * count) are in place;
    rank 1 passing its slice at another offset of the same buffer is refused."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")  # (one thread issues both ranks' parts: see below)
    fake = FakeCuda()
    comms = clique([fake], [[0, 1]])[0]
    n = 3
    bufs = [torch.arange(2.0 * n, device=sim_gpu.device(rank)) for rank in (0, 1)]
    shift = [0, n if offset == 0 else 0]  # rank 1's slice: at rank * count, or at 0
    pieces = [b[s : s + n] for b, s in zip(bufs, shift)]
    fake.nccl.group_start()  # both ranks from one thread, in one group (as ncclCommInitAll's users do)
    for rank, (piece, buf, comm) in enumerate(zip(pieces, bufs, comms)):
        with bound_to(rank):
            if op == "all_gather":
                fake.nccl.all_gather(piece, buf, comm, stream(fake, rank))
            else:
                fake.nccl.reduce_scatter(buf, piece, SUM, comm, stream(fake, rank))
    fake.nccl.group_end()
    if offset == 0:
        fake.synchronize(sim_gpu.device(0))
    else:
        with pytest.raises(RuntimeError, match="in-place rule"):
            fake.synchronize(sim_gpu.device(0))


def test_backward_runs_on_a_device_thread_without_the_rank_context():
    seen = []

    def body():
        dev = threadpar.get_device()
        w = torch.nn.Parameter(torch.ones(2, device=dev))
        w.register_post_accumulate_grad_hook(lambda p: seen.append(in_rank()))
        (w * 2).sum().backward()
        assert in_rank()
        with pytest.raises(NotInRankError):  # a hook that asks for the rank where none is
            w2 = torch.nn.Parameter(torch.ones(1, device=dev))
            w2.register_post_accumulate_grad_hook(lambda p: threadpar.get_rank())
            w2.sum().backward()
        return w.grad

    for grad in sim_gpu.to_host(run_fake_gpus(body, 2, FakeCuda(autograd_thread=True))):
        assert torch.equal(grad, torch.full((2,), 2.0))
    assert seen == [False, False]


def test_nccl_group_of_one_thread_for_two_devices_issues_both_parts():
    """(nccl_group is what threadpar's calls inside one NCCL group go through.)"""
    fake = FakeCuda()
    comms = clique([fake], [[0, 1]])[0]
    xs = [torch.ones(2, device=sim_gpu.device(rank)) for rank in (0, 1)]
    with nccl_group(fake.nccl):
        for rank in (0, 1):
            with bound_to(rank):
                fake.nccl.all_reduce(xs[rank], xs[rank], SUM, comms[rank], stream(fake, rank))
    fake.synchronize(sim_gpu.device(0))
    assert all(torch.equal(x.cpu(), torch.full((2,), 2.0)) for x in xs)
