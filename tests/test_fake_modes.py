"""The CUDA/NCCL double's stricter modes catch what a GPU would (issue 22): a lazy comm stream runs a
collective only when something waits on it, and a buffer written before that is reported as a race; NCCL's
in-place offset rule for all-gather and reduce-scatter; backward on a device thread without the rank's
context. (The weak logs are checked by test_payload_lifetime.py.)"""

import threading

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from test_nccl_double import clique

import threadpar
from threadpar import ReduceOp
from threadpar.comm.nccl.library import SUM, nccl_group
from threadpar.errors import NotInRankError
from threadpar.runtime.context import in_rank


def test_a_lazy_collective_runs_only_once_something_waits_on_it():
    both_read = threading.Barrier(2)

    def body():
        t = torch.ones(4)
        work = threadpar.all_reduce(t, ReduceOp.SUM, async_op=True)
        before = t.clone()  # read before waiting: on a slow comm stream, the old values
        both_read.wait()  # (no rank has waited on the collective yet)
        work.wait()
        return before, t

    for before, after in run_fake_gpus(body, 2, FakeCuda(lazy=True)):
        assert torch.equal(before, torch.ones(4)) and torch.equal(after, torch.full((4,), 2.0))


@pytest.mark.parametrize("which", ["input", "output"])
def test_a_buffer_written_between_launch_and_run_is_a_race(which):
    fake = FakeCuda(lazy=True)
    both_wrote = threading.Barrier(2)

    def body():
        src, out = torch.ones(4), torch.empty(8)
        work = threadpar.get_group().all_gather_into_tensor(out, src, async_op=True)
        (src if which == "input" else out).add_(1)  # before waiting on the Work
        both_wrote.wait()
        work.wait()

    with pytest.raises(RuntimeError, match=f"race: all_gather's {which}"):
        run_fake_gpus(body, 2, fake)
    assert fake.races
    assert not FakeCuda(lazy=False).races  # (eager: computed at launch, nothing to report)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("offset", [0, 1], ids=["rank-offset", "wrong-offset"])
def test_nccls_in_place_offset_rule(op, offset):
    """ncclAllGather(data + rank * count, data) and ncclReduceScatter(data, data + rank * count) are in place;
    rank 1 passing its slice at another offset of the same buffer is refused."""
    fake = FakeCuda()
    comms = clique([fake], [[0, 1]])[0]
    n = 3
    bufs = [torch.arange(2.0 * n), torch.arange(2.0 * n)]
    shift = [0, n if offset == 0 else 0]  # rank 1's slice: at rank * count, or at 0
    pieces = [b[s : s + n] for b, s in zip(bufs, shift)]
    streams = [fake.pool_stream(torch.device("cpu"), 0) for _ in range(2)]
    with fake.launch_lock:

        def call():
            with nccl_group(fake.nccl):
                for piece, buf, comm, s in zip(pieces, bufs, comms, streams):
                    if op == "all_gather":
                        fake.nccl.all_gather(piece, buf, comm, s)
                    else:
                        fake.nccl.reduce_scatter(buf, piece, SUM, comm, s)

        if offset == 0:
            call()
        else:
            with pytest.raises(RuntimeError, match="in-place rule"):
                call()


def test_backward_runs_on_a_device_thread_without_the_rank_context():
    seen = []

    def body():
        w = torch.nn.Parameter(torch.ones(2))
        w.register_post_accumulate_grad_hook(lambda p: seen.append(in_rank()))
        (w * 2).sum().backward()
        assert in_rank()
        with pytest.raises(NotInRankError):  # a hook that asks for the rank where none is
            w2 = torch.nn.Parameter(torch.ones(1))
            w2.register_post_accumulate_grad_hook(lambda p: threadpar.get_rank())
            w2.sum().backward()
        return w.grad

    for grad in run_fake_gpus(body, 2, FakeCuda(autograd_thread=True)):
        assert torch.equal(grad, torch.full((2,), 2.0))
    assert seen == [False, False]
