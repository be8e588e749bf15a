"""The GPU tier of threadpar.graphed_step (issue 33): real CUDA graph captures on rank threads, against the
single-thread model. Skipped without GPUs (tests/conftest.py)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers.ddp_reference import batches, mlp, rank_slice
from helpers.gpus import gpus_or_skip, run_gpus

import threadpar
from threadpar.errors import GraphCaptureError
from threadpar.parallel import DistributedDataParallel
from threadpar.runtime.autograd_threads import backward_on_this_thread

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]
TEMPLATE = mlp()
STEPS, WARMUP = 6, 2


def graphed_run(n: int) -> dict:
    rank, device = threadpar.get_rank(), threadpar.get_device()
    model = copy.deepcopy(TEMPLATE).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)

    def train(x, y):
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    step = threadpar.graphed_step(train, warmup_steps=WARMUP)
    for x, y in batches(steps=STEPS, rows=4 * n, n_in=6, n_out=3):
        step(*(rank_slice(t, rank, n).to(device) for t in (x, y)))
    return {"replays": step.replays, "params": [p.detach().cpu() for p in model.parameters()]}


def test_graphed_ddp_steps_on_every_gpu_match_one_thread():
    n = gpus_or_skip(1)
    model = copy.deepcopy(TEMPLATE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in batches(steps=STEPS, rows=4 * n, n_in=6, n_out=3):
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(
            model(x.to(TEMPLATE[0].weight.dtype)), y.to(TEMPLATE[0].weight.dtype)
        ).backward()
        optimizer.step()
    for result in run_gpus(graphed_run, n, n):
        assert result["replays"] == STEPS - WARMUP
        for got, want in zip(result["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_a_host_read_is_refused_at_capture_on_a_gpu():
    gpus_or_skip(1)

    def body():
        step = threadpar.graphed_step(lambda x: x * float(x.sum()), warmup_steps=1)
        t = torch.ones(4, device=threadpar.get_device())
        step(t)
        step(t)

    with pytest.raises((GraphCaptureError, RuntimeError), match="captur"):
        run_gpus(body, 1)


def test_a_tensor_made_from_host_data_cannot_be_captured_on_a_gpu():
    """What the double's rule for aten::lift_fresh mirrors (tests/fakes/fake_graph.py): torch.tensor(data,
    device=cuda) copies from pageable host memory and synchronizes the stream (Copy.cu, memcpy_and_sync)."""
    gpus_or_skip(1)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(RuntimeError, match=r"captur|not permitted"), torch.cuda.graph(graph, stream=stream):
        torch.tensor(3.0, device="cuda")


def test_backward_runs_on_the_calling_thread_with_multithreading_off_on_a_gpu():
    """What the double's device threads mirror (tests/fakes/fake_autograd_thread.py): a CUDA backward runs on
    autograd's device thread, unless the calling thread turned multithreading off (engine.cpp, ready_queue)."""
    gpus_or_skip(1)
    seen: list[int] = []
    w = torch.ones(2, device="cuda", requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda _: seen.append(threading.get_ident()))
    (w * 2).sum().backward()
    with backward_on_this_thread(True):
        (w * 2).sum().backward()
    assert seen[0] != threading.get_ident() and seen[1] == threading.get_ident()


def test_a_graphed_1f1b_pipeline_matches_its_eager_steps_on_two_gpus():
    """The stages' ncclSend/ncclRecv captured from the rehearsal's script (comm/nccl/p2p.py)."""
    gpus_or_skip(2)
    from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks

    from threadpar.pipeline import PipelineParallel

    def body(graphed: bool):
        device = threadpar.get_device()
        chunks = [c.to(device) for c in my_chunks(make_model(4), 1)]
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule="1f1b", num_microbatches=4)
        optimizer = torch.optim.AdamW(list(pipe.parameters()), lr=0.01, capturable=True)

        def train(inputs, targets):
            optimizer.zero_grad(set_to_none=False)
            loss = pipe.train_step(inputs, targets)
            optimizer.step()
            return loss

        step = threadpar.graphed_step(train, warmup_steps=WARMUP) if graphed else train
        losses = [step(*(t.to(device) for t in make_batch(8, seed=10 + i))).clone() for i in range(STEPS)]
        return torch.stack(losses).cpu(), [p.detach().cpu() for p in pipe.parameters()]

    graphed = run_gpus(body, 2, True, pp=2)
    eager = run_gpus(body, 2, False, pp=2)
    for (g_losses, g_params), (e_losses, e_params) in zip(graphed, eager):
        torch.testing.assert_close(g_losses, e_losses, rtol=1e-5, atol=1e-6)
        for g, e in zip(g_params, e_params):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
