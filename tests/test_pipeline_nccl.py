"""Pipelines on the nccl backend (issue 39): every schedule's messages on the PP group's own communicator, in
a launch order that cannot deadlock where NCCL runs a communicator's launches in order and a send waits for its
receive; shapes learned at the first step, posted at once after it. Parity with one thread, on the double, eager
and lazy; what each stage holds (one communicator); the launch orders over every schedule's grid."""

from __future__ import annotations

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, fake_gpu_processes, run_fake_gpu_processes, run_fake_gpus
from fakes.sim_gpu import to_host
from test_pipeline_executor import (
    assert_matches_reference,
    lm_loss,
    make_batch,
    make_model,
    my_chunks,
    my_gradients,
    reference,
)

import threadpar
from threadpar.errors import ConfigError
from threadpar.pipeline import PipelineParallel, build_plan
from threadpar.pipeline.lowering import lower
from threadpar.pipeline.message_order import Message, check_launch_orders, launch_orders
from threadpar.pipeline.p2p import message_tag
from threadpar.pipeline.schedule import ScheduleError, schedule_placement

SCHEDULES = ["afab", "1f1b", "interleaved", "zbh1", "zb_interleaved", "zbv"]


def _chunks(model, schedule: str, v: int):
    return my_chunks(model, v, placement=schedule_placement(schedule))


@pytest.mark.usefixtures("fake_mode")
@pytest.mark.parametrize(
    "schedule,pp,v,n",
    [
        ("afab", 2, 1, 3),
        ("1f1b", 4, 1, 5),
        ("interleaved", 2, 2, 4),
        ("zbh1", 4, 1, 4),
        ("zb_interleaved", 2, 2, 4),
        ("zbv", 2, 2, 3),
    ],
    ids=lambda x: str(x),
)
def test_every_schedule_matches_one_thread_step_after_step(schedule, pp, v, n):
    """Two steps with an optimizer between them: the first learns the messages' shapes (headers), the second
    posts every receive at once from them."""
    layers = pp * v + 1
    inputs, targets = make_batch(2 * n)
    ref_loss, ref_model = reference(layers, inputs, targets, steps=2, lr=0.1)

    def body():
        dev = threadpar.get_device()
        model = make_model(layers).to(dev)
        chunks = _chunks(model, schedule, v)
        params = [p for c in chunks for p in c.parameters()]
        pipe = PipelineParallel(
            chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=n,
            optimizer=torch.optim.SGD(params, lr=0.1),
        )  # fmt: skip
        losses = [pipe.train_step(inputs.to(dev), targets.to(dev)) for _ in range(2)]
        mine = {id(p) for p in params}
        return to_host({
            "loss": losses[-1],
            "params": {k: p.detach() for k, p in model.named_parameters() if id(p) in mine},
        })  # fmt: skip

    fake = FakeCuda()
    assert_matches_reference(run_fake_gpus(body, pp, fake, pp=pp), ref_loss, ref_model, key="params")
    assert not fake.nccl.violations


def test_a_message_whose_shape_changes_after_the_first_step_is_refused_naming_it():
    def body():
        dev = threadpar.get_device()
        pipe = PipelineParallel(my_chunks(make_model(2).to(dev), 1), loss_fn=lm_loss, num_microbatches=2)
        pipe.train_step(*(t.to(dev) for t in make_batch(4)))
        pipe.train_step(
            *(t.to(dev) for t in make_batch(6))
        )  # another microbatch size: other activation shapes

    with pytest.raises(ConfigError, match=r"sends 0F0 as float32\[3, .*at the first step"):
        run_fake_gpus(body, 2, FakeCuda(), pp=2)


def test_eval_and_a_frozen_first_chunk_on_the_double():
    """eval_step has its own launch order and shapes; a frozen first chunk gets no gradient back (its
    receives are skipped, as the gradients its receiver does not owe)."""
    inputs, targets = make_batch(4)
    ref_model = make_model(2)
    for layer in (ref_model[0], ref_model[1]):
        layer.requires_grad_(False)
    ref_loss = lm_loss(ref_model(inputs), targets)
    ref_loss.backward()

    def body():
        dev = threadpar.get_device()
        model = make_model(2).to(dev)
        for layer in (model[0], model[1]):
            layer.requires_grad_(False)
        chunks = my_chunks(model, 1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, num_microbatches=2)
        x, y = inputs.to(dev), targets.to(dev)
        out = [pipe.eval_step(x) for _ in range(2)]
        model.zero_grad()
        for _ in range(2):
            loss = pipe.train_step(x, y)
            for c in chunks:
                c.zero_grad()
        loss = pipe.train_step(x, y)
        return to_host({"loss": loss, "grads": my_gradients(model, chunks), "out": out})

    results = run_fake_gpus(body, 2, FakeCuda(), pp=2)
    torch.testing.assert_close(results[1]["loss"], ref_loss.detach())
    torch.testing.assert_close(results[1]["out"][1], ref_model(inputs).detach())
    for name, p in ref_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(results[1]["grads"][name], p.grad)


def test_stages_in_two_processes_match_one_thread():
    inputs, targets = make_batch(8)
    ref_loss, ref_model = reference(5, inputs, targets)

    def body():
        dev = threadpar.get_device()
        model = make_model(5).to(dev)
        chunks = my_chunks(model, 1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule="1f1b", num_microbatches=4)
        x, y = inputs.to(dev), targets.to(dev)
        pipe.train_step(x, y)
        model.zero_grad()
        return to_host({"loss": pipe.train_step(x, y), "grads": my_gradients(model, chunks)})

    results = run_fake_gpu_processes(body, fake_gpu_processes(2), 2, pp=4)
    assert_matches_reference([r for process in results for r in process], ref_loss, ref_model)


# the launch orders (pure) ----------------------------------------------------------------------------------------
def _plans():
    for name in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for n in (1, 2, 3, 4, 5, 8, 16):
                for v in (1, 2, 3):
                    try:
                        yield build_plan(name, pp, n, v)
                    except ConfigError:
                        continue


def test_the_launch_orders_of_every_schedule_finish_where_a_send_waits_for_its_receive():
    plans = list(_plans())
    assert len(plans) > 150
    for plan in plans:
        orders = launch_orders(plan)
        check_launch_orders(plan, orders)
        # every message between two stages once on each side, a send on its sender's, a receive on its receiver's
        sends = sorted((s, m.peer, m.tag) for s, row in enumerate(orders) for m in row if m.send)
        recvs = sorted((m.peer, s, m.tag) for s, row in enumerate(orders) for m in row if not m.send)
        assert sends == recvs and len(set(sends)) == len(sends)


def _lowered_orders(plan):
    """The order the lowered plan hands messages over in (receives posted where lowering puts them)."""
    low = lower(plan, prefetch=True)
    orders = []
    for stage, row in enumerate(low.actions):
        order = []
        for a in row:
            kinds = {"SEND_F": (True, 1, False), "SEND_B": (True, -1, True),
                     "RECV_F": (False, -1, False), "RECV_B": (False, 1, True)}  # fmt: skip
            if a.kind in kinds:
                send, step, backward = kinds[a.kind]
                peer = low.rank_of(a.chunk + step)
                edge = a.chunk if step == 1 else a.chunk - 1
                if peer != stage:
                    order.append(Message(send, peer, message_tag(a.microbatch, edge, backward)))
        orders.append(tuple(order))
    return tuple(orders)


def test_launching_in_the_lowered_plans_order_would_deadlock_and_the_check_says_so():
    """With prefetch a stage posts the receive of a gradient before it sends its next activation: launched in
    that order on one communicator, each stage's receive waits for the other's send, behind it."""
    plan = build_plan("1f1b", 2, 4, 1)
    with pytest.raises(ScheduleError, match="wait for each other"):
        check_launch_orders(plan, _lowered_orders(plan))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["zb_interleaved", "zbv"])
def test_the_zero_bubble_schedules_with_two_chunks_graph_as_they_run_eagerly(schedule):
    """(test_cuda_graphs_p2p graphs afab, 1f1b, interleaved and zbh1): the captured step's launches are the
    eager step's, in the same order, of the shapes the first step learned."""
    from test_cuda_graphs import assert_graphed_equals_eager, graphed_and_eager
    from test_cuda_graphs_p2p import pipeline_step

    steps, warmup = 5, 2
    make = pipeline_step(schedule, 2, 4)
    graphed, eager = graphed_and_eager(make, 2, warmup=warmup, steps=steps, pp=2)
    assert_graphed_equals_eager(graphed, eager, steps=steps, warmup=warmup)
