"""`parallelize` on a small GPT written with plain torch.nn, without threadpar: parity with the original."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.tp_parity import assert_grads_close, grads_of, seed_params_
from torch import nn

from threadpar.errors import ConfigError
from threadpar.parallel import (
    ColumnParallelLinear,
    ColwiseParallel,
    TrackedDropout,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    gather_dense_state_dict,
    parallelize,
)
from threadpar.testing import run_ranks

V, C, HEADS, B, T = 30, 32, 4, 2, 8


class Block(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn_qkv = nn.Linear(C, 3 * C)
        self.attn_drop = nn.Dropout(dropout)
        self.attn_proj = nn.Linear(C, C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        q, k, v = self.attn_qkv(self.ln_1(x)).chunk(3, dim=-1)
        b, t = q.shape[:2]  # from q, not x: TP-friendly code takes sizes from the tensor it splits
        q, k, v = (z.view(b, t, -1, C // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.resid_drop(self.attn_proj(self.attn_drop(y)))
        return x + self.resid_drop(self.mlp(self.ln_2(x)))


class TinyGPT(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(dropout), Block(dropout)])
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
        ({"tok_emb": "vocab"}, {}, r"share a weight, but the parallelize_plan shards only the first"),
        ({}, {}, "non-empty dict"),
        (
            PLAN,
            {"dropout": 0.1},
            r"'blocks.0.attn_drop' is an nn.Dropout\(p=0.1\) the parallelize_plan does not cover",
        ),
    ],
)
def test_bad_plans_raise_clear_errors(plan, kwargs, message):
    dense = TinyGPT(**kwargs)
    with pytest.raises(ConfigError, match=message):
        run_ranks(lambda: parallelize(copy.deepcopy(dense), plan), 2, tp=2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_dropout_in_the_plan_draws_masks_that_fit_the_activation(sp):
    """'dropout' on the residual branches: without SP the residual stream is replicated and stays identical
    on the TP ranks (it feeds the final norm); under SP it is split by sequence, so each rank draws its own
    mask. Putting it in the TP region without SP makes the replicas of the residual stream diverge."""
    dense = seed_params_(TinyGPT(dropout=0.2), seed=63)
    idx, targets = data(64)
    right = {
        **(SP_PLAN if sp else PLAN),
        "blocks.*.attn_drop": "tp_dropout",
        "blocks.*.resid_drop": "dropout",
    }
    wrong = {**right, "blocks.*.resid_drop": "tp_dropout"}

    def body(plan):
        model = parallelize(copy.deepcopy(dense), plan, sequence_parallel=sp)
        seen = []
        model.ln_f.register_forward_hook(lambda module, args, out: seen.append(args[0].detach()))
        train_loss = model(idx, targets)
        train_loss.backward()
        model.eval()
        flags = [m.in_tp_region for m in model.modules() if isinstance(m, TrackedDropout)]
        return train_loss.detach(), model(idx, targets).detach(), seen[0], flags

    results = run_ranks(body, 2, tp=2, kwargs={"plan": right})
    torch.testing.assert_close(
        results[0][1], copy.deepcopy(dense).eval()(idx, targets)
    )  # eval: the dense result
    assert not torch.allclose(results[0][0], results[0][1])  # training drops
    assert results[0][3] == [True, sp] * 2  # attn_drop in the TP region; resid_drop there only under SP
    if not sp:
        assert torch.equal(results[0][2], results[1][2])  # the replicated residual stream agrees
        diverged = run_ranks(body, 2, tp=2, kwargs={"plan": wrong})
        assert not torch.allclose(diverged[0][2], diverged[1][2])


def test_bad_style_options_are_rejected():
    with pytest.raises(ConfigError, match="gather_output must be a bool"):
        ColwiseParallel(gather_output="yes")
    with pytest.raises(TypeError):
        ColwiseParallel(True)  # keyword-only
