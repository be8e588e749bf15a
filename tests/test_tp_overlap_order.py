"""ColumnParallelLinear's overlapped backward, in order: the input-gradient collective is in flight while
the weight gradient is computed (threads: event order; nccl: stream order on the CUDA/NCCL double), and a
backward split into input and weight halves does each part once."""

import copy
import threading

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from helpers.tp_overlap_probe import CollectiveLog, GemmLog
from helpers.tp_parity import my_chunk, randn, seed_params_
from torch import nn

import threadpar
from threadpar.parallel import ColumnParallelLinear
from threadpar.testing import run_ranks

# Sizes where the GEMMs differ in shape: weight [20, 24] per rank at tp 2, 2 x 6 = 12 tokens.
IN, OUT, ORDER_B, ORDER_T = 24, 40, 2, 6
OVERLAPPED = {
    False: ["dgrad", "start all_reduce", "wgrad", "wait all_reduce"],
    True: [
        "start all_gather", "dgrad", "wait all_gather",  # the input gathered again, during the dX GEMM
        "start reduce_scatter", "wgrad", "wait reduce_scatter",
    ],
}  # fmt: skip


def probed_backward(sp: bool, overlap: bool, around=None):
    """On a rank: a column layer's forward, then its backward under the probes; the events in order."""
    device = threadpar.get_device()
    fc = seed_params_(nn.Linear(IN, OUT), seed=7).to(device)
    x = randn(ORDER_B, ORDER_T, IN, seed=16).to(device)
    layer = ColumnParallelLinear.from_dense(fc, sequence_parallel=sp, overlap_grad_comm=overlap)
    events: list[str] = []
    log = CollectiveLog(layer.group, events, threading.Lock())
    xi = (my_chunk(x, 1) if sp else x).requires_grad_()
    loss = layer(xi).square().sum()
    log.recording = True
    with GemmLog(log, ORDER_B * ORDER_T, tuple(layer.weight.shape), around):
        loss.backward()
    log.recording = False
    return events


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_the_input_gradient_collective_is_in_flight_while_the_weight_gradient_is_computed(sp):
    """Threads backend: the collective is issued asynchronously before the dW GEMM and waited on after it.
    The non-overlapped path, for contrast, computes both GEMMs and then runs a blocking collective."""
    for events in run_ranks(lambda: probed_backward(sp, overlap=True), 2, tp=2):
        assert events == OVERLAPPED[sp]
    last = "sync reduce_scatter" if sp else "sync all_reduce"
    for events in run_ranks(lambda: probed_backward(sp, overlap=False), 2, tp=2):
        assert sorted(events[:-1]) == ["dgrad", "wgrad"] and events[-1] == last, events


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_on_nccl_the_collective_runs_on_the_comm_stream_beside_the_weight_gradient_gemm(sp):
    """nccl backend (the CUDA/NCCL double): each GEMM is bracketed by marks on the rank's compute stream;
    `fake.ordered(a, b)` says whether CUDA must finish a before b starts. The collective waits for the dX
    GEMM (its input), neither waits for the dW GEMM nor is waited for by it, and the compute stream waits
    for it before anything after backward: the dW GEMM and NCCL's kernel can run at once."""
    fake = FakeCuda()

    def body(overlap):
        marks, device = {}, threadpar.get_device()

        def around(kind, when):
            marks[f"{when} {kind}"] = fake.mark(fake.current_stream(device), f"{when} {kind}")

        events = probed_backward(sp, overlap, around)
        marks["after backward"] = fake.mark(fake.current_stream(device), "after backward")
        return events, marks, threadpar.get_group("TP").rank()

    name = "reduce_scatter" if sp else "all_reduce"
    for events, marks, rank in run_fake_gpus(lambda: body(True), 2, fake, tp=2):
        assert events == OVERLAPPED[sp]
        (call,) = fake.calls_of(name, rank)
        node = call.node
        assert call.stream in fake.comm_streams
        assert fake.ordered(marks["after dgrad"], node)
        assert not fake.ordered(marks["after wgrad"], node)
        assert not fake.ordered(node, marks["before wgrad"])
        assert fake.ordered(node, marks["after backward"])
        if sp:  # the backward's gather of the input: beside the dX GEMM, before the dW GEMM
            gather = fake.calls_of("all_gather", rank)[-1].node
            assert not fake.ordered(gather, marks["before dgrad"])
            assert not fake.ordered(marks["after dgrad"], gather)
            assert fake.ordered(gather, marks["before wgrad"])

    fake.calls.clear()
    for _, marks, rank in run_fake_gpus(lambda: body(False), 2, fake, tp=2):  # no overlap: after dW
        (call,) = fake.calls_of(name, rank)
        assert fake.ordered(marks["after wgrad"], call.node)


SPLIT = {  # the events of the B half (input gradient) and the W half (weight gradients)
    False: (["dgrad", "start all_reduce", "wait all_reduce"], ["wgrad"]),
    True: (
        ["dgrad", "start reduce_scatter", "wait reduce_scatter"],
        ["start all_gather", "wait all_gather", "wgrad"],
    ),
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_a_backward_split_into_input_and_weight_halves_does_each_part_once(sp):
    """Zero-bubble schedules run backward twice with torch.autograd.grad(inputs=): B towards the input,
    W towards the weights. The Function asks the engine which gradients this pass needs, so B computes dX
    and its collective only, W the gather (SP) and dW only; both equal a fused backward's."""
    ln, fc = nn.LayerNorm(IN), nn.Linear(IN, OUT)
    seed_params_(ln, seed=8)
    seed_params_(fc, seed=9)
    x = randn(ORDER_B, ORDER_T, IN, seed=17)

    def body():
        layer = ColumnParallelLinear.from_dense(fc, sequence_parallel=sp, overlap_grad_comm=True)
        xi = (my_chunk(x, 1) if sp else x).requires_grad_()
        loss = layer(copy.deepcopy(ln)(xi)).square().sum()
        fused = torch.autograd.grad(loss, [xi, layer.weight, layer.bias], retain_graph=True)
        halves = []
        log = CollectiveLog(layer.group, [], threading.Lock())
        for wanted in ([xi], [layer.weight, layer.bias]):
            log.events = []
            log.recording = True
            with GemmLog(log, ORDER_B * ORDER_T, tuple(layer.weight.shape)):
                grads = torch.autograd.grad(loss, wanted, retain_graph=True)
            log.recording = False
            halves.append((log.events, grads))
        return fused, halves

    for fused, (b, w) in run_ranks(body, 2, tp=2):
        assert (b[0], w[0]) == SPLIT[sp]
        for got, want in zip([*b[1], *w[1]], fused):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
