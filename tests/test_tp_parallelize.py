"""`parallelize` on a small GPT written with plain torch.nn, without threadpar: parity with the original."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tp_parity import assert_grads_close, grads_of, seed_params_

from threadpar.errors import ConfigError
from threadpar.parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    gather_dense_state_dict,
    parallelize,
)
from threadpar.testing import run_ranks

V, C, HEADS, B, T = 30, 32, 4, 2, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn_qkv = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        q, k, v = self.attn_qkv(self.ln_1(x)).chunk(3, dim=-1)
        b, t = q.shape[:2]  # from q, not x: TP-friendly code takes sizes from the tensor it splits
        q, k, v = (z.view(b, t, -1, C // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.attn_proj(y)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as in GPT-2

    def forward(self, idx, targets):
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


PLAN = {
    "tok_emb": "vocab",
    "blocks.*.attn_qkv": ColwiseParallel(stride=3),
    "blocks.*.attn_proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
    "head": ColwiseParallel(gather_output=True),  # whole logits: the model's own loss works unchanged
}
SP_PLAN = {**PLAN, "blocks.*.ln_*": "sequence", "ln_f": "sequence"}


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parallelized_model_matches_the_original(tp, sp):
    dense = seed_params_(TinyGPT(), seed=60)
    batches = [data(61), data(62)]
    reference = copy.deepcopy(dense)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    want_losses = []
    for step, (idx, targets) in enumerate(batches):
        opt.zero_grad()
        loss = reference(idx, targets)
        loss.backward()
        want_losses.append(loss.detach())
        if step == 0:
            want_grads = grads_of(reference)
        opt.step()

    def body():
        model = parallelize(copy.deepcopy(dense), SP_PLAN if sp else PLAN, sequence_parallel=sp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step, (idx, targets) in enumerate(batches):
            opt.zero_grad()
            loss = model(idx, targets)
            loss.backward()
            allreduce_sequence_parallel_grads(model)
            losses.append(loss.detach())
            if step == 0:
                grads = gather_dense_grads(model)
            opt.step()
        tied = model.head.weight is model.tok_emb.weight
        kinds = (type(model.tok_emb), type(model.head), type(model.blocks[0].mlp[0]))
        return losses, grads, gather_dense_state_dict(model), tied, kinds

    for losses, grads, state, tied, kinds in run_ranks(body, tp, tp=tp):
        assert tied and kinds[:2] == (VocabParallelEmbedding, ColumnParallelLinear)
        assert kinds[2] is ColumnParallelLinear
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses))
        assert_grads_close(grads, want_grads)
        assert_grads_close(state, reference.state_dict())


@pytest.mark.parametrize(
    ("plan", "kwargs", "message"),
    [
        (
            {"blocks.*.attn_qvk": "colwise"},
            {},
            r"'blocks.\*.attn_qvk' matches no module; module names are like",
        ),
        ({"ln_f": "colwise"}, {}, "matched 'ln_f', a LayerNorm; it applies to Linear only"),
        ({"blocks.*.ln_1": "sequence"}, {}, "pass sequence_parallel=True"),
        ({"head": "diagonal"}, {}, "not a style"),
        ({"blocks.0.mlp.0": "colwise", "blocks.*.mlp.0": "rowwise"}, {}, "with different styles"),
        ({"tok_emb": "vocab"}, {}, r"share a weight, but the plan shards only the first"),
        ({}, {}, "non-empty dict"),
    ],
)
def test_bad_plans_raise_clear_errors(plan, kwargs, message):
    dense = TinyGPT()
    with pytest.raises(ConfigError, match=message):
        run_ranks(lambda: parallelize(copy.deepcopy(dense), plan, **kwargs), 2, tp=2)


def test_bad_style_options_are_rejected():
    with pytest.raises(ConfigError, match="gather_output must be a bool"):
        ColwiseParallel(gather_output="yes")
    with pytest.raises(TypeError):
        ColwiseParallel(True)  # keyword-only
