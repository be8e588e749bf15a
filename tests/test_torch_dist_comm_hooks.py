"""torch DDP communication hooks whose Future callbacks issue collectives (PowerSGD's), on rank threads.

PowerSGD's hook all-reduces a bucket's uncompressed tensors, then in `then` callbacks all-reduces P and Q
and waits for each. Such callbacks must issue their collectives in the rank's program order: threadpar's
`then` waits for the op and runs the callback on the calling thread (comm/common/work.py, OrderedFuture).
Before, the callback ran on the rank's communication worker when the op completed, where its all-reduce
queued behind the op running it: the launch hung until the collective timeout.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.torch_dist_models import batch, reference_steps, seeded
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import threadpar

P = 2
STEPS = 4
INPUTS = [batch(4 * P, seed=s) for s in range(STEPS)]


def mse(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def model() -> nn.Module:
    # Weights 6 x 8 and 4 x 6: PowerSGD of rank 8 keeps min(rows, 8) = every row, so its P is square and
    # orthogonal and P P^T M = M: the compressed average is the exact one, up to float32's orthogonalization
    # error. PowerSGD seeds its first Q from the process's shared generator (fork_rng + manual_seed), which
    # rank threads share (DESIGN rule 3), so ranks may start from different Qs: the average stays exact,
    # its rounding differs (up to 7e-4 here in 1 run of 17; a bug such as a missing division by the world
    # size moves the parameters by about 5e-2).
    return seeded(nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)))


def train(template: nn.Module, hook) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    rank = dist.get_rank()
    local = copy.deepcopy(template)
    ddp = nn.parallel.DistributedDataParallel(local)
    hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in INPUTS:
        mse(ddp(x.chunk(P)[rank])).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in local.named_parameters()}


def test_powersgd_matches_one_thread_and_compresses_from_its_start_step():
    template = model()
    want = reference_steps(template, INPUTS, mse)
    compressed = []

    def hooked(ddp: nn.parallel.DistributedDataParallel) -> None:
        state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=8, start_powerSGD_iter=2, min_compression_rate=0
        )
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        compressed.append(state)

    results = threadpar.launch(train, template, hooked, world_size=P, devices="cpu", timeout=30)
    for name, value in want.items():
        torch.testing.assert_close(results[1][name], results[0][name], rtol=0, atol=0)  # one average
        torch.testing.assert_close(results[0][name], value, rtol=0, atol=5e-3)
    # The compressed path ran: its P and Q buffers exist only once a step past start_powerSGD_iter used it.
    assert all(state.iter == STEPS and state.p_memory_dict for state in compressed)


def test_a_callback_chain_that_issues_collectives_runs_in_program_order():
    """A hook like PowerSGD's, reduced to exact arithmetic: all-reduce the bucket, then in a callback
    all-reduce a second tensor (the bucket's squares) and wait; ranks must agree on every step."""
    template = model()
    want = reference_steps(template, INPUTS, mse)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks real annotations
        buffer = bucket.buffer()
        squares = buffer * buffer

        def second(fut: torch.futures.Future) -> torch.Tensor:
            average = fut.value()[0].div_(dist.get_world_size())
            dist.all_reduce(squares, async_op=True).get_future().wait()
            return average

        return dist.all_reduce(buffer, async_op=True).get_future().then(second)

    results = threadpar.launch(
        train,
        template,
        lambda ddp: ddp.register_comm_hook(None, hook),
        world_size=P,
        devices="cpu",
        timeout=30,
    )
    for got in results:
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)


def test_an_async_collective_from_a_done_callback_is_refused_not_hung():
    """A callback run by the communication worker as an op completes (add_done_callback on a pending op)
    cannot issue an asynchronous op: it would queue behind the op running it. A clear error, not a hang."""
    attached = threading.Event()  # rank 1 joins the first all-reduce only once rank 0's callback waits on it

    def body() -> None:
        if threadpar.get_rank() == 1:
            assert attached.wait(timeout=30)
            threadpar.all_reduce(torch.ones(4))
            return
        first = threadpar.all_reduce(torch.ones(4), async_op=True).get_future()
        outcome: torch.futures.Future = torch.futures.Future()

        def issue(_: torch.futures.Future) -> None:
            try:
                threadpar.all_reduce(torch.ones(4), async_op=True)
            except BaseException as error:
                outcome.set_exception(error)
            else:
                outcome.set_result(None)

        first.add_done_callback(issue)
        attached.set()
        outcome.wait()

    with pytest.raises(threadpar.RankFailedError, match="must not issue asynchronous operations"):
        threadpar.launch(body, world_size=P, devices="cpu", timeout=30)


def test_then_on_an_op_of_several_works_also_runs_on_the_rank_thread():
    """all_gather_coalesced of two tensors is two threadpar ops under one c10d Work: its future too."""

    def body() -> tuple[str, float]:
        rank = dist.get_rank()
        inputs = [torch.full((3,), rank + 1.0), torch.full((2,), 10.0 * (rank + 1))]
        outputs = [[torch.empty_like(t) for _ in range(P)] for t in inputs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates all_gather_coalesced
            future = dist.all_gather_coalesced(outputs, inputs, async_op=True)  # torch returns the future

        def second(done: torch.futures.Future) -> tuple[str, float]:
            total = torch.stack([t.sum() for t in done.value()]).sum().reshape(1)
            dist.all_reduce(total, async_op=True).get_future().wait()
            return threading.current_thread().name, total.item()

        return future.then(second).wait()

    results = threadpar.launch(body, world_size=P, devices="cpu", timeout=30)
    # Every rank gathers 3 x (1 + 2) + 2 x (10 + 20) = 69; the all-reduce sums the two ranks' 69.
    assert results == [("threadpar-rank-0", 138.0), ("threadpar-rank-1", 138.0)]
