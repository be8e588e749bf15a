"""Work.get_future(): torch's API for chaining work onto an asynchronous collective (used by DDP's hooks)."""

import threading

import pytest
import torch

import threadpar
from threadpar.comm.common.work import CompletedWork, LazyWork, Work
from threadpar.parallel.ddp.comm_hooks import then
from threadpar.testing import run_ranks


def test_future_of_an_async_all_reduce_holds_its_tensor_and_done_callbacks_run_on_the_comm_worker():
    chained_while_pending = threading.Event()  # rank 1 joins the all-reduce only after rank 0 chained on it

    def body():
        rank = threadpar.get_rank()
        t = torch.full((1000,), float(rank + 1))
        ran_on = []
        if rank == 1:
            assert chained_while_pending.wait(timeout=30)
        future = threadpar.all_reduce(t, async_op=True).get_future()
        doubled = then(future, lambda value: ran_on.append(threading.current_thread().name) or value[0] * 2)
        if rank == 0:
            assert not future.done()  # cannot be: rank 1 has not called all_reduce yet
            chained_while_pending.set()
        assert doubled.wait()[0].item() == 6.0
        assert future.value()[0] is t
        return ran_on

    assert run_ranks(body, 2)[0] == ["threadpar-comm-0"]


def test_then_waits_for_the_op_and_runs_its_callback_on_the_rank_thread_in_program_order():
    """So a callback may issue collectives (PowerSGD's hook): they come in the rank's program order."""
    issued = threading.Event()  # rank 1 joins the all-reduce only once rank 0 has issued it

    def body():
        rank = threadpar.get_rank()
        if rank == 1:
            assert issued.wait(timeout=30)
        t = torch.full((4,), float(rank + 1))
        future = threadpar.all_reduce(t, async_op=True).get_future()
        if rank == 0:
            issued.set()

        def second(done: torch.futures.Future) -> tuple[str, float]:
            again = threadpar.all_reduce(done.value()[0].clone(), async_op=True)
            assert again is not None
            return threading.current_thread().name, again.get_future().wait()[0][0].item()

        chained = future.then(second)
        assert chained.done()  # then() ran the callback before returning
        return chained.value()

    assert run_ranks(body, 2) == [("threadpar-rank-0", 6.0), ("threadpar-rank-1", 6.0)]


def test_get_future_after_completion_and_twice():
    work = CompletedWork("done", result=7)
    assert work.get_future() is work.get_future()
    assert work.get_future().wait() == 7
    pending = Work("pending")
    future = pending.get_future()
    assert not future.done()
    pending._finish(result=[1])
    assert future.wait() == [1]


def test_future_of_a_lazy_work_taken_before_wait_gets_its_result():
    # LazyWork (an irecv's Work) once kept its completion function in a slot named like Work's own
    # _complete(future), so a future taken before wait() called the receive with the future as timeout.
    calls = []

    def receive(timeout):
        calls.append(timeout)
        return 3

    work = LazyWork("irecv", receive, lambda: True)
    future = work.get_future()
    assert work.wait()
    assert future.done() and future.wait() == 3 and calls == [None]


def test_errors_keep_their_type_through_get_future_and_then():
    def body():
        shape = (3,) if threadpar.get_rank() == 0 else (4,)
        future = threadpar.all_reduce(torch.zeros(shape), async_op=True).get_future()
        with pytest.raises(threadpar.ThreadparError, match="mismatch"):
            future.wait()
        with pytest.raises(threadpar.ThreadparError, match="mismatch"):
            then(future, lambda value: value).wait()

    run_ranks(body, 2)


def test_then_passes_the_value_and_captures_the_callback_error():
    future = torch.futures.Future()
    doubled = then(future, lambda value: value * 2)
    failing = then(future, lambda value: {}[value])
    future.set_result(21)
    assert doubled.wait() == 42
    with pytest.raises(KeyError):
        failing.wait()
