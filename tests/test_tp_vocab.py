"""Vocabulary parallelism: embedding + LM head + vocab-parallel cross-entropy against the dense model and
against torch's F.cross_entropy (label smoothing, padded vocabularies, ignored targets, reductions)."""

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
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    mark_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from threadpar.parallel.tensor_parallel.sharding import padded_size
from threadpar.testing import run_ranks

B, T, C, V = 2, 8, 16, 30  # V = 30 is padded to 32 below


def tokens(seed, ignore=True):
    t = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    if ignore:
        t[0, 2] = t[1, 5] = -100  # ignored targets
    return t


class LM(nn.Module):
    """Embedding -> final norm -> head: the ends of a GPT."""

    def __init__(self, emb, ln_f, head, tied):
        super().__init__()
        self.emb, self.ln_f, self.head = emb, ln_f, head
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.ln_f(self.emb(idx)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_head_and_cross_entropy_match_dense(tp, sp, tied):
    dense = LM(nn.Embedding(V, C), nn.LayerNorm(C), nn.Linear(C, V, bias=False), tied)
    seed_params_(dense, seed=40)
    idx, target = tokens(41, ignore=False), tokens(42)
    logits = dense(idx)
    want = F.cross_entropy(logits.view(-1, V), target.view(-1), label_smoothing=0.1)
    want.backward()

    def body():
        model = LM(
            VocabParallelEmbedding.from_dense(
                dense.emb, pad_vocab_to_multiple_of=4, reduce_scatter_embeddings=sp
            ),
            copy.deepcopy(dense.ln_f),
            ColumnParallelLinear.from_dense(
                dense.head, pad_out_features_to_multiple_of=4, sequence_parallel=sp
            ),
            tied,
        )
        if sp:
            mark_sequence_parallel(model.ln_f)
        logits_parallel = model(idx)  # [B, T, 32 / tp], whole sequence
        loss = vocab_parallel_cross_entropy(logits_parallel, target, label_smoothing=0.1, vocab_size=V)
        loss.backward()
        allreduce_sequence_parallel_grads(model)
        return loss.detach(), logits_parallel.detach(), gather_dense_grads(model)

    results = run_ranks(body, tp, tp=tp)
    gathered = torch.cat([r[1] for r in results], dim=-1)  # [B, T, 32]
    torch.testing.assert_close(gathered[..., :V], logits.detach())
    assert (gathered[..., V:] == 0).all()  # padded classes: zero rows of the head
    for loss, _, grads in results:
        torch.testing.assert_close(loss, want.detach())
        assert_grads_close(grads, grads_of(dense))


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize(
    ("tp", "vocab", "multiple"),
    [(1, 30, 1), (2, 30, 1), (4, 30, 1), (4, 10, 8), (2, 30, 16)],
    ids=["tp1", "tp2", "tp4-padded", "tp4-ranks-all-padding", "tp2-padded"],
)
def test_cross_entropy_matches_torch(tp, vocab, multiple, smoothing):
    padded = padded_size(vocab, tp, multiple)
    logits = randn(3, 5, vocab, seed=50) * 3
    junk = randn(3, 5, padded - vocab, seed=51) * 50  # padded classes: must not count
    target = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(52))
    target[0, 1] = target[2, 4] = -100
    expected = {}
    for reduction in ("mean", "sum", "none"):
        ld = logits.clone().requires_grad_()
        loss = F.cross_entropy(ld.transpose(1, 2), target, label_smoothing=smoothing, reduction=reduction)
        upstream = randn(*loss.shape, seed=53)
        (loss * upstream).sum().backward()
        expected[reduction] = (loss.detach(), ld.grad, upstream)

    def body():
        rank = threadpar.get_group("TP").rank()
        full = torch.cat([logits, junk], dim=-1)
        out = {}
        for reduction, (_, _, upstream) in expected.items():
            local = full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(
                local, target, label_smoothing=smoothing, vocab_size=vocab, reduction=reduction
            )
            (loss * upstream).sum().backward()
            out[reduction] = (loss.detach(), local.grad)
        return out

    results = run_ranks(body, tp, tp=tp)
    for reduction, (want_loss, want_grad, _) in expected.items():
        grad = torch.cat([r[reduction][1] for r in results], dim=-1)
        torch.testing.assert_close(grad[..., :vocab], want_grad, msg=f"gradient, reduction={reduction}")
        assert (grad[..., vocab:] == 0).all()
        for r in results:
            torch.testing.assert_close(r[reduction][0], want_loss, msg=f"loss, reduction={reduction}")


def test_cross_entropy_of_bf16_logits_is_computed_in_fp32_and_module_matches_function():
    logits = (randn(4, 6, 32, seed=54) * 4).to(torch.bfloat16)
    target = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(55))
    ld = logits.float().requires_grad_()
    want = F.cross_entropy(ld.view(-1, 32), target.view(-1), label_smoothing=0.1)
    want.backward()

    def body():
        rank = threadpar.get_group("TP").rank()
        local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=0.1)
        loss.backward()
        module = VocabParallelCrossEntropyLoss(label_smoothing=0.1)(local.detach(), target)
        return loss.detach(), local.grad, module

    results = run_ranks(body, 2, tp=2)
    for loss, _, module in results:
        assert loss.dtype == torch.float32
        # fp32 math on bf16 inputs: the loss is not rounded to bf16
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(module, loss)
    grad = torch.cat([r[1] for r in results], dim=-1)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ld.grad, rtol=1e-2, atol=1e-3)


def test_embedding_padding_idx_row_gets_no_gradient():
    dense = seed_params_(nn.Embedding(V, C, padding_idx=9), seed=56)
    idx = tokens(57, ignore=False)
    idx[0, :3] = 9
    upstream = randn(B, T, C, seed=58)
    out = dense(idx)
    (out * upstream).sum().backward()

    def body():
        emb = VocabParallelEmbedding.from_dense(dense)  # keeps padding_idx=9 (on rank 1 of 4: rows 8..15)
        y = emb(idx)
        (y * upstream).sum().backward()
        return y.detach(), gather_dense_grads(emb), emb.local_padding_idx

    for rank, (y, grads, local_padding_idx) in enumerate(run_ranks(body, 4, tp=4)):
        torch.testing.assert_close(y, out.detach())
        assert_grads_close(grads, grads_of(dense))
        assert (grads["weight"][9] == 0).all()
        assert local_padding_idx == (1 if rank == 1 else None)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"target": torch.zeros(3, dtype=torch.int64)}, ConfigError, "without the last"),
        ({"vocab_size": 40}, ConfigError, r"vocab_size must be an int in \[1, 32\]"),
        ({"reduction": "avg"}, ConfigError, "reduction must be one of"),
        ({"label_smoothing": 1.5}, ConfigError, "label_smoothing"),
        ({"target": torch.zeros(2, 3)}, TypeError, "int64"),
    ],
)
def test_cross_entropy_rejects_bad_arguments(kwargs, error, message):
    def body():
        args = {"target": torch.zeros(2, 3, dtype=torch.int64), **kwargs}
        vocab_parallel_cross_entropy(torch.randn(2, 3, 16), **args)

    with pytest.raises(error, match=message):
        run_ranks(body, 2, tp=2)
