"""Multi-head causal self-attention with its heads split across the TP ranks, against the dense block.

The TP block is how a GPT uses the layers: a column-parallel q/k/v projection (fused with stride 3, or
three projections sharing one entry into the TP region), attention over this rank's heads, and a
row-parallel output projection; under sequence parallelism the input and output are sequence shards.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.tp_parity import assert_grads_close, grads_of, my_chunk, randn, seed_params_
from torch import nn

from threadpar.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    gather_dense_grads,
    gather_from_sp_region,
)
from threadpar.testing import run_ranks

B, T, C, HEADS = 2, 8, 32, 4
HEAD_DIM = C // HEADS


def attend(q, k, v):
    """[B, T, h * d] each -> [B, T, h * d]; the number of heads h comes from the tensors."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, -1, HEAD_DIM).transpose(1, 2) for z in (q, k, v))  # [B, h, T, d]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, -1)


class DenseAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)  # nanoGPT's layout: [q; k; v] along the output
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        return self.proj(attend(*self.qkv(x).split(C, dim=-1)))


class FusedTPAttention(nn.Module):
    def __init__(self, dense, sp):
        super().__init__()
        # stride=3: q, k and v are each split by heads, so this rank gets [q_r; k_r; v_r]
        self.qkv = ColumnParallelLinear.from_dense(dense.qkv, stride=3, sequence_parallel=sp)
        self.proj = RowParallelLinear.from_dense(dense.proj, sequence_parallel=sp)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [B, T, C / tp] each: HEADS / tp heads
        return self.proj(attend(q, k, v))


class SplitTPAttention(nn.Module):
    """Separate q, k, v projections that share one entry into the TP region (one gradient all-reduce)."""

    def __init__(self, dense, sp):
        super().__init__()
        self.sp = sp
        w, b = dense.qkv.weight.detach(), dense.qkv.bias.detach()
        for i, name in enumerate("qkv"):
            linear = nn.Linear(C, C)
            linear.load_state_dict({"weight": w[i * C : (i + 1) * C], "bias": b[i * C : (i + 1) * C]})
            setattr(self, name, ColumnParallelLinear.from_dense(linear, input_is_parallel=True))
        self.proj = RowParallelLinear.from_dense(dense.proj, sequence_parallel=sp)

    def forward(self, x):
        group = self.proj.group
        x = gather_from_sp_region(x, group) if self.sp else copy_to_tp_region(x, group)
        return self.proj(attend(self.q(x), self.k(x), self.v(x)))


@pytest.mark.parametrize("variant", ["fused", "split"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_attention_with_heads_split_matches_dense(tp, sp, variant):
    dense = seed_params_(DenseAttention(), seed=30)
    x, w = randn(B, T, C, seed=31), randn(B, T, C, seed=32)
    xd = x.clone().requires_grad_()
    want = dense(xd)
    (want * w).sum().backward()

    def body():
        model = (FusedTPAttention if variant == "fused" else SplitTPAttention)(dense, sp)
        split = (lambda t: my_chunk(t, 1)) if sp else (lambda t: t.clone())
        xi = split(x).requires_grad_()
        y = model(xi)
        (y * split(w)).sum().backward()
        allreduce_sequence_parallel_grads(model)
        grads = gather_dense_grads(model)
        if variant == "split":  # put q, k, v back into the dense fused layout
            grads["qkv.weight"] = torch.cat([grads.pop(f"{n}.weight") for n in "qkv"])
            grads["qkv.bias"] = torch.cat([grads.pop(f"{n}.bias") for n in "qkv"])
        return y.detach(), xi.grad, grads, model.proj.weight.shape

    results = run_ranks(body, tp, tp=tp)
    join = (lambda ts: torch.cat(ts, dim=1)) if sp else (lambda ts: ts[0])
    torch.testing.assert_close(join([r[0] for r in results]), want.detach())
    torch.testing.assert_close(join([r[1] for r in results]), xd.grad)
    for _, _, grads, proj_shape in results:
        assert proj_shape == (C, C // tp)  # each rank holds HEADS / tp heads' columns
        assert_grads_close(grads, grads_of(dense))
