"""Ring attention against full attention on one thread: outputs and q/k/v gradients, cp = 2 and 4, causal or
not, both block kernels; then an attention block with heads split over TP (and SP) and the sequence over
CP, against the dense block, through two optimizer steps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.tp_parity import assert_grads_close, grads_of, randn, seed_params_
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    ColumnParallelLinear,
    RingAttention,
    RowParallelLinear,
    allreduce_context_parallel_grads,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    gather_dense_state_dict,
    get_padding,
    mark_sequence_parallel,
    pad_sequence,
    restore_sequence_order,
    ring_attention,
    split_sequence,
)
from threadpar.testing import run_processes, run_ranks

B, H, T, D = 2, 4, 16, 8  # T = 16: two chunks of 2 positions per rank at cp = 4


def full_attention(q, k, v, w, causal):
    """Reference on the test's thread: output and gradients of sum(attention * w)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def ring_on_ranks(q, k, v, w, cp, processes=1, **kwargs):
    """Each CP rank takes its load-balanced part of the sequence (dim 2), runs ring attention and the same
    loss; the parts of the output and gradients are put back in sequence order. With processes > 1 the
    ranks are threads of that many (simulated) processes, so the ring crosses processes."""

    def body():
        ql, kl, vl = (split_sequence(t, dim=2).requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, **kwargs)
        (out * split_sequence(w, dim=2)).sum().backward()
        return out.detach(), ql.grad, kl.grad, vl.grad

    if processes == 1:
        per_rank = run_ranks(body, cp, cp=cp)
    else:
        per_rank = [r for process in run_processes(body, processes, cp // processes, cp=cp) for r in process]
    return [restore_sequence_order(torch.cat(parts, dim=2), cp, dim=2) for parts in zip(*per_rank)]


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_full_attention(cp, causal, kernel):
    q, k, v, w = (randn(B, H, T, D, seed=s) for s in range(4))
    want = full_attention(q, k, v, w, causal)
    got = ring_on_ranks(q, k, v, w, cp, causal=causal, kernel=kernel)
    for name, g, e in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"{name}: {m}")


def test_ring_attention_across_processes():
    q, k, v, w = (randn(B, H, T, D, seed=s) for s in range(4))
    want = full_attention(q, k, v, w, causal=True)
    got = ring_on_ranks(q, k, v, w, 4, processes=2)  # 2 processes x 2 threads: two ring hops cross over
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.bfloat16, 3e-2)], ids=["float64", "bfloat16"]
)
def test_ring_attention_in_other_dtypes(dtype, tol):
    q, k, v, w = (randn(B, H, T, D, seed=s).to(dtype) for s in range(4))
    want = full_attention(*(t.double() for t in (q, k, v, w)), causal=True)
    got = ring_on_ranks(q, k, v, w, 4, causal=True, scale=None)
    for g, e in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e, rtol=tol, atol=tol)


def test_padded_sequence_gives_the_unpadded_attention_on_real_positions():
    cp, t_real = 2, 13
    pad = get_padding(t_real, cp)
    assert pad == 3
    q, k, v, w = (randn(B, H, t_real, D, seed=s) for s in range(4))
    want = full_attention(q, k, v, w, causal=True)
    # padded positions come last, so no real query sees them; their loss weight is 0
    padded = [pad_sequence(t, pad, dim=2) for t in (q, k, v, w)]
    got = ring_on_ranks(*padded, cp, causal=True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g[:, :, :t_real], e)
    assert got[1][:, :, t_real:].abs().sum() == 0  # no gradient flows into the padded queries


class DenseAttention(nn.Module):
    """x + proj(causal attention(qkv(x))) on [B, T, C]."""

    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)  # [q; k; v] along the output
        self.proj = nn.Linear(c, c)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        qkv = self.qkv(self.ln(x))
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, -1, D).transpose(1, 2) for z in qkv.chunk(3, dim=-1))  # [B, h, T, D]
        return x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1))


class ParallelAttention(DenseAttention):
    """The same block with heads split over TP (q/k/v column-parallel with stride 3, proj row-parallel)
    and the sequence over CP (ring attention); under SP the residual stream is split over TP too."""

    def __init__(self, dense, sp):
        nn.Module.__init__(self)
        self.ln = copy.deepcopy(dense.ln)
        if sp:
            mark_sequence_parallel(self.ln)
        self.qkv = ColumnParallelLinear.from_dense(dense.qkv, stride=3, sequence_parallel=sp)
        self.proj = RowParallelLinear.from_dense(dense.proj, sequence_parallel=sp)
        self.ring = RingAttention()  # this rank's CP group, captured now

    def attend(self, q, k, v):
        return self.ring(q, k, v)


@pytest.mark.parametrize(("cp", "tp", "sp"), [(2, 1, False), (2, 2, False), (2, 2, True), (4, 2, False)])
def test_attention_block_with_cp_and_tp_matches_dense_through_optimizer_steps(cp, tp, sp):
    c, heads, steps = H * D, H, 2
    dense = nn.Sequential(*(seed_params_(DenseAttention(c, heads), seed=40 + i) for i in range(2)))
    xs = [randn(B, T, c, seed=50 + i) for i in range(steps)]
    w = randn(B, T, c, seed=60) / (B * T)  # loss: a sum over tokens / the whole sequence's token count

    def train(model, inputs, weight, sync=lambda m: None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first = None
        for x in inputs:
            opt.zero_grad()
            x = x.clone().requires_grad_()
            y = model(x)
            (y * weight).sum().backward()
            sync(model)
            first = first or (y.detach(), x.grad, grads_of(model))
            opt.step()
        return first

    reference = copy.deepcopy(dense)
    want_y, want_dx, want_grads = train(reference, xs, w)

    def body():
        model = nn.Sequential(*(ParallelAttention(block, sp) for block in dense))
        tp_group = threadpar.get_group("TP")

        def local(t):  # this rank's part: CP's two chunks, then its TP slice of them under SP
            t = split_sequence(t, dim=1)
            return t.chunk(tp, dim=1)[tp_group.rank()].contiguous() if sp else t

        def sync(m):
            allreduce_sequence_parallel_grads(m)
            allreduce_context_parallel_grads(m)

        y, dx, _ = train(model, [local(x) for x in xs[:1]], local(w), sync)
        grads = gather_dense_grads(model)
        train(model, [local(x) for x in xs[1:]], local(w), sync)
        return y, dx, grads, gather_dense_state_dict(model)

    results = run_ranks(body, cp * tp, cp=cp, tp=tp)
    layout = threadpar.Layout.build(cp * tp, cp=cp, tp=tp)

    def whole(
        i,
    ):  # reassemble outputs / input grads from the ranks of TP index 0 (and every TP rank under SP)
        parts = []
        for cp_rank in range(cp):
            ranks = [layout.rank_of(cp=cp_rank, tp=t) for t in range(tp if sp else 1)]
            parts.append(torch.cat([results[r][i] for r in ranks], dim=1))
        return restore_sequence_order(torch.cat(parts, dim=1), cp, dim=1)

    torch.testing.assert_close(whole(0), want_y)
    torch.testing.assert_close(whole(1), want_dx)
    for _, _, grads, state in results:
        assert_grads_close(grads, want_grads)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(
                state[name], value, msg=lambda m, name=name: f"{name} after steps: {m}"
            )


def test_cp_of_one_is_plain_attention_and_errors_are_clear():
    q, k, v = (randn(B, H, 6, D, seed=s) for s in range(3))

    def single():
        out = ring_attention(q, k, v)  # cp = 1: F.scaled_dot_product_attention itself
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    run_ranks(single, 2)  # dp = 2, cp = 1

    def errors():
        odd = torch.zeros(1, 2, 3, 4)
        with pytest.raises(ConfigError, match="get_padding"):
            ring_attention(odd, odd, odd)
        with pytest.raises(ConfigError, match="one shape"):
            ring_attention(q[:, :, :4], k[:, :2, :4], v[:, :, :4])
        with pytest.raises(ConfigError, match=r"\[batch, heads, seq, head_dim\]"):
            ring_attention(q[0], k[0], v[0])
        with pytest.raises(ConfigError, match="kernel must be one of"):
            RingAttention(kernel="fast")
        with pytest.raises(ConfigError, match="not a member"):
            ring_attention(q, k, v, group=threadpar.new_group([1 - threadpar.get_rank()]))
        assert "cp=2" in repr(RingAttention())

    run_ranks(errors, 2, cp=2)


def test_tp_layers_initialise_alike_on_every_cp_rank():
    """CP ranks hold replicas of one model: the TP layers' INIT stream must not depend on the CP rank."""

    def body():
        layer = ColumnParallelLinear(8, 8)
        return threadpar.get_coords(), gather_dense_state_dict(layer)["weight"]

    results = run_ranks(body, 4, cp=2, tp=2)
    assert {c.cp for c, _ in results} == {0, 1}
    assert all(torch.equal(w, results[0][1]) for _, w in results)
