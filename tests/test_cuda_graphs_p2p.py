"""Point to point in a graphed step: pipelines (PipelineParallel) and ring attention, whose messages are
captured from the rehearsal's script (comm/common/graph_capture.py, comm/nccl/p2p.py), on the double's
capture and replay. Graphed runs against the same steps run eagerly, exactly, and what a capture refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, fake_gpu_processes, run_fake_gpu_processes, run_fake_gpus
from test_cuda_graphs import assert_graphed_equals_eager, graphed_and_eager, run_refused
from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks

import threadpar
from threadpar import GraphCaptureError
from threadpar.parallel import (
    DistributedDataParallel,
    allreduce_context_parallel_grads,
    ring_attention,
    split_sequence,
)
from threadpar.pipeline import PipelineParallel
from threadpar.pipeline.schedule import schedule_placement

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("fake_mode")]

STEPS, WARMUP = 6, 2


def pipeline_step(
    schedule: str, v: int, n: int, *, layers: int = 4, ddp: bool = False, prefetch: bool = True
):
    """make() for graphed_and_eager: a pipelined GPT-like model stepping AdamW (capturable) on each stage."""

    def make():
        model = make_model(layers).to(threadpar.get_device())
        chunks = my_chunks(model, v, placement=schedule_placement(schedule))
        if ddp:
            chunks = [DistributedDataParallel(c, bucket_cap_mb=0, first_bucket_cap_mb=0) for c in chunks]
        pipe = PipelineParallel(
            chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=n, prefetch=prefetch
        )
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.05, capturable=True)

        def train(inputs, targets):
            opt.zero_grad(set_to_none=False)
            loss = pipe.train_step(inputs, targets)
            opt.step()
            return loss

        batches = [make_batch(2 * n, seed=10 + i) for i in range(STEPS)]
        return train, lambda: list(pipe.parameters()), lambda i: batches[i]

    return make


@pytest.mark.parametrize(
    "schedule,pp,v,n",
    [("1f1b", 2, 1, 4), ("1f1b", 4, 1, 4), ("interleaved", 2, 2, 4), ("afab", 2, 1, 2)],
    ids=lambda x: str(x),
)
def test_a_pipelined_step_graphs_as_it_runs_eagerly(schedule, pp, v, n):
    graphed, eager = graphed_and_eager(pipeline_step(schedule, v, n), pp, warmup=WARMUP, steps=STEPS, pp=pp)
    assert_graphed_equals_eager(graphed, eager, steps=STEPS, warmup=WARMUP)


def test_a_zero_bubble_pipeline_with_data_parallel_stages_graphs_as_it_runs_eagerly():
    graphed, eager = graphed_and_eager(
        pipeline_step("zbh1", 1, 4, ddp=True), 4, warmup=WARMUP, steps=STEPS, pp=2, dp=2
    )
    assert_graphed_equals_eager(graphed, eager, steps=STEPS, warmup=WARMUP)


def test_a_step_that_sends_otherwise_at_capture_than_at_its_rehearsal_is_refused():
    calls = [0]

    def step_fn(x):
        calls[0] += 1
        if threadpar.get_rank() == 0:
            threadpar.send(x if calls[0] < 3 else x[:1], 1)  # the capture (call 3 on rank 0) sends less
        else:
            threadpar.recv(x, 0)
        return x

    with pytest.raises(GraphCaptureError, match=r"sends \(1,\).*rehearsal\) sent \(4,\)"):
        run_refused(step_fn)


def test_point_to_point_that_starts_in_the_capture_is_refused():
    calls = [0]

    def step_fn(x):
        calls[0] += 1
        if calls[0] > 2 and threadpar.get_rank() == 0:
            threadpar.send(x, 1)
        return x

    with pytest.raises(GraphCaptureError, match="rehearsal"):
        run_refused(step_fn)


def test_a_pipelined_step_graphs_when_backward_runs_on_autograd_device_threads():
    # On a GPU autograd runs backward on a device thread; graphed_step runs the rehearsal's and the capture's
    # on the rank thread (where its marks are), the replays need none.
    def run(graphed: bool, fake: FakeCuda):
        def body():
            train, _, batch = pipeline_step("1f1b", 1, 4)()
            step = threadpar.graphed_step(train, warmup_steps=WARMUP) if graphed else train
            dev = threadpar.get_device()
            return torch.stack([step(*(t.to(dev) for t in batch(i))).detach().cpu() for i in range(STEPS)])

        return run_fake_gpus(body, 2, fake, pp=2)

    for g, e in zip(run(True, FakeCuda(autograd_thread=True)), run(False, FakeCuda())):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_context_parallel_graphs_as_it_runs_eagerly(cp):
    batch, heads, length, dim = 2, 2, 16, 8

    torch.manual_seed(0)
    template = torch.nn.Linear(dim, 3 * dim)

    def make():
        proj = copy.deepcopy(template).to(threadpar.get_device())
        opt = torch.optim.AdamW(proj.parameters(), lr=0.05, capturable=True)

        def train(x):  # x: [batch, heads, length / cp, dim], this rank's part of the sequence
            opt.zero_grad(set_to_none=False)
            q, k, v = (t.contiguous() for t in proj(x).chunk(3, dim=-1))
            loss = ring_attention(q, k, v, causal=True).square().mean()
            loss.backward()
            allreduce_context_parallel_grads(proj)
            opt.step()
            return loss.detach()

        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(batch, heads, length, dim, generator=g) for _ in range(STEPS)]
        return train, lambda: list(proj.parameters()), lambda i: (split_sequence(xs[i], dim=2),)

    graphed, eager = graphed_and_eager(make, cp, warmup=WARMUP, steps=STEPS, cp=cp)
    assert_graphed_equals_eager(graphed, eager, steps=STEPS, warmup=WARMUP)


def test_a_pipeline_across_two_processes_graphs_as_it_runs_eagerly():
    # Each process captures on its own (one capture per process); the stages' pair communicators span the
    # processes, their messages announced through the message router eagerly and scripted at capture.
    def run(graphed: bool) -> list[torch.Tensor]:
        def body():
            train, _, batch = pipeline_step("1f1b", 1, 4)()
            step = threadpar.graphed_step(train, warmup_steps=WARMUP) if graphed else train
            dev = threadpar.get_device()
            return torch.stack([step(*(t.to(dev) for t in batch(i))).detach().cpu() for i in range(STEPS)])

        fakes = fake_gpu_processes(2)
        return [r for process in run_fake_gpu_processes(body, fakes, 1, pp=2) for r in process]

    for g, e in zip(run(True), run(False)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
