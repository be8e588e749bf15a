"""Asynchronous collectives: Work handles, overlap with computation, issue order."""

import threading

import pytest
import torch

import threadpar
from threadpar.testing import run_ranks


def test_async_all_reduce_returns_work_that_completes():
    def body():
        t = torch.full((1000,), float(threadpar.get_rank() + 1))
        work = threadpar.all_reduce(t, async_op=True)
        assert isinstance(work, threadpar.Work)
        assert work.wait() is True
        assert work.is_completed() and work.exception() is None
        return t[0].item()

    assert run_ranks(body, 3) == [6.0, 6.0, 6.0]


def test_async_op_progresses_while_the_rank_computes():
    """Rank 0 issues an async all-reduce and then "computes" until rank 1's blocking all-reduce has returned.
    That can only happen if rank 0's communication worker runs the all-reduce meanwhile: were it run on
    rank 0's own thread (at wait()), rank 1 would never return and rank 0's wait for it would time out."""
    rank1_returned = threading.Event()

    def body():
        t = torch.ones(4)
        if threadpar.get_rank() == 0:
            work = threadpar.all_reduce(t, async_op=True)
            progressed = rank1_returned.wait(timeout=30)  # stands for computation that outlasts rank 1
            work.wait()
            return progressed
        threadpar.all_reduce(t)
        rank1_returned.set()
        return t[0].item()

    assert run_ranks(body, 2) == [True, 2.0]


def test_sync_op_after_async_ops_keeps_issue_order():
    def body():
        t = torch.ones(8)
        works = [threadpar.all_reduce(t, async_op=True) for _ in range(3)]
        threadpar.all_reduce(t)  # queued behind the three above: (((1*2)*2)*2)*2
        assert all(w.is_completed() for w in works)
        return t[0].item()

    assert run_ranks(body, 2) == [16.0, 16.0]


def test_async_errors_surface_at_wait():
    def body():
        if threadpar.get_rank() == 0:
            work = threadpar.all_reduce(torch.zeros(3), async_op=True)
        else:
            work = threadpar.all_reduce(torch.zeros(4), async_op=True)
        with pytest.raises(threadpar.ThreadparError):
            work.wait()
        assert work.exception() is not None

    run_ranks(body, 2)


def test_wait_with_timeout_raises_when_the_peer_is_late():
    timed_out = threading.Event()  # rank 1 arrives only after rank 0's wait(timeout=0.1) has given up

    def body():
        if threadpar.get_rank() == 0:
            work = threadpar.barrier(async_op=True)
            with pytest.raises(threadpar.CollectiveTimeoutError, match=r"did not complete within 0\.1 s"):
                work.wait(timeout=0.1)
            timed_out.set()
            work.wait()
        else:
            assert timed_out.wait(timeout=30)
            threadpar.barrier()

    run_ranks(body, 2)


def test_async_ops_issued_under_no_grad_from_tensors_that_require_grad():
    """In backward (grad mode off) a layer gathers a saved input that requires grad into a fresh buffer.
    torch's c10d ops write outputs outside autograd (ProcessGroup ops are not differentiable), so the comm
    worker must not run them with grad mode on: writing a requires-grad input into views made under no_grad
    would raise "A view was created in no_grad mode and is being modified inplace"."""

    def body():
        rank = threadpar.get_rank()
        x = torch.full((4, 3), float(rank + 1), requires_grad=True)
        with torch.no_grad():
            out = torch.empty(2, 4, 3)
            work = threadpar.all_gather_into_tensor(out, x, async_op=True)
            work.wait()
        return out[:, 0, 0].tolist(), out.requires_grad

    assert run_ranks(body, 2) == [([1.0, 2.0], False)] * 2
