"""ColumnParallelLinear's overlapped backward equals the non-overlapped path and the dense model (threads
and the nccl double); the switch and its default. The order of its work: test_tp_overlap_order.py."""

import copy
import importlib
import threading

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host
from helpers.gpt_reference import check_against, hybrid_step, reference
from helpers.tp_parity import (
    assert_grads_close,
    backward_off_the_rank_thread,
    dense_mlp_block,
    grads_of,
    my_chunk,
    randn,
    seed_params_,
    tp_mlp_block,
)
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.models.gpt import GPT, GPTConfig, TensorParallel
from threadpar.models.parallelize_gpt import parallelize_chunk
from threadpar.parallel import (
    ColumnParallelLinear,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    parallelize,
)
from threadpar.testing import run_ranks

B, T, C, FFN = 2, 8, 16, 64


def dense_mlp():
    return dense_mlp_block(C, FFN)


def tp_mlp(dense, sp, overlap):
    return tp_mlp_block(dense, sp, overlap_grad_comm=overlap)


def accumulate(model, inputs, upstream, sync=lambda m: None):
    """Forward + backward of each micro-batch, gradients accumulated; (outputs, input grads, param grads)."""
    ys, x_grads = [], []
    for x in inputs:
        xi = x.clone().requires_grad_()
        y = model(xi)
        (y * upstream).sum().backward()
        ys.append(y.detach())
        x_grads.append(xi.grad)
    sync(model)
    return ys, x_grads


RUNNERS = {
    "threads": lambda body, tp: run_ranks(body, tp, tp=tp),
    "nccl": lambda body, tp: to_host(run_fake_gpus(body, tp, FakeCuda(), tp=tp)),  # the CUDA/NCCL double
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize(("backend", "tp"), [("threads", 2), ("threads", 4), ("nccl", 2)])
def test_overlapped_block_equals_the_non_overlapped_block_and_the_dense_one_with_accumulated_grads(
    backend, tp, sp
):
    """Two micro-batches accumulate into .grad (the layers have no separate main-grad buffers)."""
    dense = dense_mlp()
    inputs = [randn(B, T, C, seed=10 + i) for i in range(2)]
    upstream = randn(B, T, C, seed=20)
    want_ys, want_xgrads = accumulate(dense, inputs, upstream)
    want_grads = grads_of(dense)
    split = (lambda t: my_chunk(t, 1)) if sp else (lambda t: t)

    def body():
        device, results = threadpar.get_device(), {}
        here = copy.deepcopy(dense).to(
            device
        )  # (the TP layers are made from the dense ones, on their device)
        for overlap in (True, False):
            model = tp_mlp(here, sp, overlap)
            ys, x_grads = accumulate(
                model,
                [split(x).to(device) for x in inputs],
                split(upstream).to(device),
                allreduce_sequence_parallel_grads,
            )
            results[overlap] = (ys, x_grads, gather_dense_grads(model))
        return results

    join = (lambda ts: torch.cat(ts, dim=1)) if sp else (lambda ts: ts[0])
    ranks = RUNNERS[backend](body, tp)
    for overlap in (True, False):
        for i in range(len(inputs)):
            torch.testing.assert_close(join([r[overlap][0][i] for r in ranks]), want_ys[i])
            torch.testing.assert_close(join([r[overlap][1][i] for r in ranks]), want_xgrads[i])
        for r in ranks:
            assert_grads_close(r[overlap][2], want_grads)
    for r in ranks:  # the two paths compute the same sums in the same order
        for a, b in zip(r[True][1], r[False][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert_grads_close(r[True][2], r[False][2], rtol=0, atol=0)


OPTIONS: tuple[
    tuple[int, int, bool, dict], ...
] = (  # (dense layer seed, out features, bias, ColumnParallelLinear options)
    (3, 24, False, {"stride": 3}),  # a fused q/k/v projection
    (4, 8, True, {"skip_bias_add": True}),
    (5, 8, True, {"gather_output": True}),
    (6, 8, False, {}),  # its weight is frozen
)


def option_layers():
    layers = [seed_params_(nn.Linear(C, out, bias=bias), seed=seed) for seed, out, bias, _ in OPTIONS]
    layers[3].weight.requires_grad_(False)
    return layers


def option_loss(outputs):
    return sum((k + 1) * o.square().sum() for k, o in enumerate(outputs))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_overlap_with_layer_options_a_frozen_weight_and_an_input_without_grad(sp):
    """Each layer's local outputs enter the loss on their rank (the gathered one whole on every rank), so
    the gradients are the dense ones. The frozen layer also runs on an input that needs no gradient."""
    dense = option_layers()
    x, x_const = randn(B, T, C, seed=12), randn(B, T, C, seed=13)
    xd = x.clone().requires_grad_()
    skip = dense[1]
    outs = [dense[0](xd), skip(xd), dense[2](xd), dense[3](xd), dense[3](x_const)]
    option_loss(outs).backward()
    split = (lambda t: my_chunk(t, 1)) if sp else (lambda t: t)

    def body():
        results = {}
        for overlap in (True, False):
            layers = [
                ColumnParallelLinear.from_dense(m, sequence_parallel=sp, overlap_grad_comm=overlap, **opts)
                for m, (_, _, _, opts) in zip(dense, OPTIONS)
            ]
            xi = split(x).clone().requires_grad_()
            h, bias = layers[1](xi)
            gathered = layers[2](xi)
            outs = [layers[0](xi), h + bias, gathered, layers[3](xi), layers[3](split(x_const))]
            option_loss(outs).backward()
            assert layers[3].weight.grad is None
            results[overlap] = (gathered.detach(), xi.grad, [gather_dense_grads(m) for m in layers[:3]])
        return results

    join = (lambda ts: torch.cat(ts, dim=1)) if sp else (lambda ts: ts[0])
    ranks = run_ranks(body, 2, tp=2)
    for overlap in (True, False):
        for r in ranks:
            torch.testing.assert_close(r[overlap][0], outs[2].detach())
            for got, layer in zip(r[overlap][2], dense[:3]):
                assert_grads_close(got, grads_of(layer))
        torch.testing.assert_close(join([r[overlap][1] for r in ranks]), xd.grad)
    for r in ranks:
        torch.testing.assert_close(r[True][1], r[False][1], rtol=0, atol=0)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_overlap_under_bf16_autocast_equals_the_non_overlapped_path(sp):
    """GEMMs in bf16 as F.linear's under autocast, the input gradient reduced in the input's dtype, and
    fp32 gradients for the fp32 parameters: bit-identical to the non-overlapped path."""
    dense = dense_mlp()
    x, upstream = randn(B, T, C, seed=14), randn(B, T, C, seed=24)
    split = (lambda t: my_chunk(t, 1)) if sp else (lambda t: t)

    def body():
        results = {}
        for overlap in (True, False):
            model = tp_mlp(dense, sp, overlap)
            xi = split(x).clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(xi)
            (y.float() * split(upstream)).sum().backward()
            allreduce_sequence_parallel_grads(model)
            results[overlap] = (y.detach(), xi.grad, gather_dense_grads(model))
        return results

    for r in run_ranks(body, 2, tp=2):
        assert r[True][1].dtype == torch.float32
        assert all(g.dtype == torch.float32 for g in r[True][2].values())
        torch.testing.assert_close(r[True][0], r[False][0], rtol=0, atol=0)
        torch.testing.assert_close(r[True][1], r[False][1], rtol=0, atol=0)
        assert_grads_close(r[True][2], r[False][2], rtol=0, atol=0)


def test_backward_runs_on_a_thread_without_rank_context():
    """The Function holds the group the layer captured: on CUDA backward runs on torch's device threads."""
    dense = dense_mlp()
    x = randn(B, T, C, seed=15)
    xd = x.clone().requires_grad_()
    dense.fc1(xd).square().sum().backward()

    def body():
        layer = ColumnParallelLinear.from_dense(dense.fc1, sequence_parallel=True, overlap_grad_comm=True)
        xi = my_chunk(x, 1).requires_grad_()
        backward_off_the_rank_thread(layer(xi).square().sum())
        return xi.grad, gather_dense_grads(layer)

    ranks = run_ranks(body, 2, tp=2)
    torch.testing.assert_close(torch.cat([r[0] for r in ranks], dim=1), xd.grad)
    for r in ranks:
        assert_grads_close(r[1], grads_of(dense.fc1))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_gpt_with_and_without_overlap_matches_the_plain_model(sp):
    """TensorParallel(overlap_grad_comm=...) reaches every column layer: q/k/v, the MLP, the LM head."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8)
    plain = GPT(config).init_weights(torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    idx, targets = (torch.randint(0, config.vocab_size, (2, 8), generator=g) for _ in range(2))
    want_loss = plain.loss(idx, targets)
    want_loss.backward()

    def body():
        results = {}
        for overlap in (True, False):
            tp = TensorParallel(
                group=threadpar.get_group("TP"), sequence_parallel=sp, overlap_grad_comm=overlap
            )
            model = parallelize_chunk(GPT(config), tp=tp)
            model.load_state_dict(plain.state_dict())
            columns = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
            assert len(columns) == 5 and all(m.overlap_grad_comm is overlap for m in columns)
            loss = model.loss(idx, targets)
            loss.backward()
            allreduce_sequence_parallel_grads(model)
            results[overlap] = (loss.detach(), gather_dense_grads(model))
        return results

    for r in run_ranks(body, 2, tp=2):
        for overlap in (True, False):
            torch.testing.assert_close(r[overlap][0], want_loss.detach())
            assert_grads_close(r[overlap][1], grads_of(plain), rtol=1e-4, atol=1e-6)


def test_overlap_switch_in_the_constructor_and_in_parallelize():
    def body():
        on = ColumnParallelLinear(C, FFN, overlap_grad_comm=True)
        off = ColumnParallelLinear(C, FFN, overlap_grad_comm=False)
        model = parallelize(
            nn.Sequential(nn.Linear(C, FFN), nn.GELU(), nn.Linear(FFN, C)),
            {"0": "colwise", "2": "rowwise"},
            overlap_grad_comm=False,
        )
        with pytest.raises(ConfigError, match="overlap_grad_comm must be True, False or None"):
            ColumnParallelLinear(C, FFN, overlap_grad_comm="yes")  # type: ignore[arg-type]
        return (
            on.overlap_grad_comm,
            off.overlap_grad_comm,
            model.get_submodule("0").overlap_grad_comm,
            repr(off),
        )

    for on, off, parallelized, text in run_ranks(body, 2, tp=2):
        assert (on, off, parallelized) == (True, False, False)
        assert "overlap_grad_comm=False" in text


@pytest.mark.parametrize(
    ("backend", "cores", "expected"),
    [("threads", 2, False), ("threads", 3, True), ("threads", 64, True), ("nccl", 1, True)],
)
def test_overlap_is_on_by_default_where_the_collective_can_run_beside_the_gemm(
    monkeypatch, backend, cores, expected
):
    """nccl: always (the comm stream). threads: only with a core beyond 2 ranks x 1 intra-op thread, for
    the comm worker."""
    monkeypatch.setattr(importlib.import_module("threadpar.runtime.launch"), "available_cores", lambda: cores)

    def body():
        return ColumnParallelLinear(C, FFN).overlap_grad_comm, parallelize(
            nn.Sequential(nn.Linear(C, FFN)), {"0": "colwise"}
        ).get_submodule("0").overlap_grad_comm

    if backend == "nccl":
        results = run_fake_gpus(body, 2, FakeCuda(), tp=2)
    else:
        results = run_ranks(body, 2, tp=2, intraop_threads=1)
    assert results == [(expected, expected)] * 2


@pytest.mark.parametrize("schedule", ["zbh1", "zbv"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_zero_bubble_gpt_with_overlapped_tp_layers_equals_the_single_thread_model(monkeypatch, schedule, sp):
    """The pipeline's B/W split runs each overlapped column layer's backward in both halves (B: dX and its
    collective, W: dW), on every TP rank in the same order: loss and every gradient as the plain model."""
    monkeypatch.setattr(importlib.import_module("threadpar.runtime.launch"), "available_cores", lambda: 64)
    layers = importlib.import_module("threadpar.parallel.tensor_parallel.layers")
    calls, lock = [0], threading.Lock()
    overlapped = layers.linear_with_async_grad_comm

    def counted(*args, **kwargs):
        with lock:
            calls[0] += 1
        return overlapped(*args, **kwargs)

    monkeypatch.setattr(layers, "linear_with_async_grad_comm", counted)
    ref = reference()
    options = {"sequence_parallel": sp}
    results = run_ranks(hybrid_step, 8, ref, schedule, 4, kwargs=options, dp=2, tp=2, pp=2, intraop_threads=1)
    check_against(ref, results)
    assert calls[0] > 0  # the default turned the overlap on (64 cores > 8 ranks x 1 thread)
