"""The TP autograd mappings: forward and backward of each against results computed from every rank's data.

Rank r's input and upstream gradient are built from (r, seed), so the test rebuilds all ranks' tensors
and checks, for instance, that the backward of copy_to_tp_region is the sum of every rank's gradient.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.tp_parity import backward_off_the_rank_thread

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
)
from threadpar.testing import run_ranks

SHAPE = (4, 8, 12)  # every dim divides by 4 ranks


def rank_tensor(rank, seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank), dtype=torch.float64)


def cat(ts, dim):
    return torch.cat(ts, dim)


def chunk(t, tp, r, dim):
    return t.chunk(tp, dim)[r]


# name -> (call(x, dim), replicated input?, expected forward, expected input gradient)
# xs / gs: every rank's input / upstream gradient; r: the rank; d: the dim the mapping works on.
CASES = {
    "copy_to_tp_region": (
        lambda x, d: copy_to_tp_region(x),
        True,
        lambda xs, r, tp, d: xs[0],
        lambda gs, r, tp, d: sum(gs),
    ),
    "reduce_from_tp_region": (
        lambda x, d: reduce_from_tp_region(x),
        False,
        lambda xs, r, tp, d: sum(xs),
        lambda gs, r, tp, d: gs[r],
    ),
    "scatter_to_tp_region": (
        lambda x, d: scatter_to_tp_region(x),
        True,
        lambda xs, r, tp, d: chunk(xs[0], tp, r, -1),
        lambda gs, r, tp, d: cat(gs, -1),
    ),
    "gather_from_tp_region": (
        lambda x, d: gather_from_tp_region(x),
        False,
        lambda xs, r, tp, d: cat(xs, -1),
        lambda gs, r, tp, d: chunk(gs[r], tp, r, -1),
    ),
    "scatter_to_sp_region": (
        lambda x, d: scatter_to_sp_region(x, dim=d),
        True,
        lambda xs, r, tp, d: chunk(xs[0], tp, r, d),
        lambda gs, r, tp, d: cat(gs, d),
    ),
    "gather_from_sp_region": (
        lambda x, d: gather_from_sp_region(x, dim=d),
        False,
        lambda xs, r, tp, d: cat(xs, d),
        lambda gs, r, tp, d: chunk(sum(gs), tp, r, d),
    ),
    "gather_from_sp_region(split grad)": (
        lambda x, d: gather_from_sp_region(x, dim=d, tensor_parallel_output_grad=False),
        False,
        lambda xs, r, tp, d: cat(xs, d),
        lambda gs, r, tp, d: chunk(gs[r], tp, r, d),
    ),
    "reduce_scatter_to_sp_region": (
        lambda x, d: reduce_scatter_to_sp_region(x, dim=d),
        False,
        lambda xs, r, tp, d: chunk(sum(xs), tp, r, d),
        lambda gs, r, tp, d: cat(gs, d),
    ),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_mapping_forward_and_backward(name, tp):
    call, replicated, forward, backward = CASES[name]
    dims = [0, 1, -2] if "sp_region" in name else [None]

    def body():
        rank = threadpar.get_group("TP").rank()
        results = []
        for d in dims:
            x = rank_tensor(0 if replicated else rank, seed=1).requires_grad_()
            y = call(x, d)
            g = rank_tensor(rank, seed=2, shape=y.shape)
            y.backward(g)
            results.append((y.detach(), x.grad))
        return results

    per_rank = run_ranks(body, tp, tp=tp)
    xs = [rank_tensor(0 if replicated else r, seed=1) for r in range(tp)]
    for i, d in enumerate(dims):
        out_shape = per_rank[0][i][0].shape
        gs = [rank_tensor(r, seed=2, shape=out_shape) for r in range(tp)]
        for r in range(tp):
            y, x_grad = per_rank[r][i]
            torch.testing.assert_close(y, forward(xs, r, tp, d), msg=f"{name} forward, rank {r}, dim {d}")
            torch.testing.assert_close(
                x_grad, backward(gs, r, tp, d), msg=f"{name} backward, rank {r}, dim {d}"
            )


@pytest.mark.parametrize("name", list(CASES))
def test_mapping_is_the_identity_on_one_rank(name):
    call = CASES[name][0]

    def body():
        x = torch.randn(SHAPE, requires_grad=True)
        return call(x, 1) is x

    assert run_ranks(body, 2, tp=1) == [True, True]


def test_mappings_leave_their_input_and_upstream_gradient_untouched():
    def body():
        rank = threadpar.get_group("TP").rank()
        x = rank_tensor(rank, seed=3).requires_grad_()
        before = x.detach().clone()
        y = copy_to_tp_region(reduce_from_tp_region(x))
        g = rank_tensor(rank, seed=4)
        g_before = g.clone()
        y.backward(g)
        return torch.equal(x.detach(), before) and torch.equal(g, g_before)

    assert all(run_ranks(body, 2, tp=2))


def test_splitting_an_uneven_sequence_says_what_to_do():
    def body():
        scatter_to_sp_region(torch.randn(2, 7, 4), dim=1)

    with pytest.raises(ConfigError, match=r"sequence length.*7.*not divisible by the tensor-parallel size 2"):
        run_ranks(body, 2, tp=2)


def test_backward_runs_without_a_rank_context():
    """DESIGN.md rule 2: the Functions use the handle captured in forward, so backward works on any thread (on CUDA
    it runs on PyTorch's device threads). Here backward runs on a plain thread started by the rank."""

    def body():
        rank = threadpar.get_group("TP").rank()
        x = rank_tensor(0, seed=5).requires_grad_()
        a = copy_to_tp_region(x) * (rank + 1)  # the ranks' partial products of a replicated input
        b = gather_from_sp_region(scatter_to_tp_region(x), dim=0)  # whole x (rearranged) on every rank
        loss = reduce_from_tp_region(a.sum() + b.sum() * (rank + 1))
        backward_off_the_rank_thread(loss)
        return x.grad

    grads = run_ranks(body, 2, tp=2)
    # loss = sum_r (r + 1) * (sum(x) + sum(x)) over 2 ranks = 6 sum(x)
    torch.testing.assert_close(grads[0], torch.full(SHAPE, 6.0, dtype=torch.float64))
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("tp", [2, 4])
def test_seed_simple_tensor_parallel_forward_reproduces_the_dense_model(tp):
    """Seed 004: per layer, a local matmul with this rank's columns, gelu, all-gather, concatenate. The
    forward alone needs nothing else; with copy_to_tp_region on each layer input the gradients match too."""
    batch, dim, layers = 16, 32, 3
    data = rank_tensor(0, seed=6, shape=(batch, dim)).float()
    params = [rank_tensor(i, seed=7, shape=(dim, dim)).float() / dim**0.5 for i in range(layers)]

    def dense(x, ws):
        for w in ws:
            x = F.gelu(x @ w)
        return x

    ws = [w.clone().requires_grad_() for w in params]
    want = dense(data, ws)
    want.square().sum().backward()

    def body():
        group = threadpar.get_group("TP")
        local = [w.chunk(tp, dim=1)[group.rank()].clone().requires_grad_() for w in params]  # [dim, dim / tp]
        x = data
        for w in local:
            x_local = F.gelu(x @ w)  # [batch, dim / tp]
            pieces = [torch.empty_like(x_local) for _ in range(tp)]
            group.all_gather(pieces, x_local.detach())  # the seed's plain all-gather + concat
            x = torch.cat(pieces, dim=1)  # [batch, dim], whole on every rank
        plain = x
        x = data
        for w in local:  # the same with autograd mappings, for gradients
            x = gather_from_tp_region(F.gelu(copy_to_tp_region(x, group) @ w), group)
        x.square().sum().backward()
        return plain, x.detach(), [w.grad for w in local]

    results = run_ranks(body, tp, tp=tp)
    for plain, mapped, _ in results:
        torch.testing.assert_close(plain, want.detach())
        torch.testing.assert_close(mapped, want.detach())
    for i, w in enumerate(ws):
        torch.testing.assert_close(torch.cat([r[2][i] for r in results], dim=1), w.grad)
