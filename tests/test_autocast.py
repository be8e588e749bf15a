"""Mixed precision in every wrapper: DDP, the TP layers (with SP and the vocab-parallel loss) and
PipelineParallel(autocast_dtype=...) under bf16 autocast equal the same recipe on one thread."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    mark_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from threadpar.pipeline import PipelineParallel, build_chunks
from threadpar.testing import run_ranks

BF16 = torch.bfloat16
# Splitting a bf16 matmul (over the batch, or the features of a row-parallel layer) rounds partial sums
# where the dense one rounds once: compare at bf16 precision (its epsilon is 2^-8 = 3.9e-3).
TOL = {"rtol": 2e-2, "atol": 2e-3}
G = torch.Generator().manual_seed(0)
VOCAB, HIDDEN, SEQ = 64, 32, 8
TOKENS = torch.randint(0, VOCAB, (8, SEQ), generator=G)
TARGETS = torch.randint(0, VOCAB, (8, SEQ), generator=G)


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> MLP -> LM head, plain; `parallel` swaps in the TP layers (SP optional)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x)


DENSE = TinyLM()


def dense_recipe():
    """One thread, the whole batch, bf16 autocast: (loss, {name: grad})."""
    model = TinyLM()
    model.load_state_dict(DENSE.state_dict())
    with torch.autocast("cpu", dtype=BF16):
        logits = model(TOKENS)
        assert logits.dtype == BF16
        loss = F.cross_entropy(logits.flatten(0, 1), TARGETS.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class ParallelLM(nn.Module):
    """TinyLM from the TP layers: vocab-parallel embedding and head, column/row MLP, replicated norm."""

    def __init__(self, sp: bool) -> None:
        super().__init__()
        self.sp = sp
        self.emb = VocabParallelEmbedding.from_dense(DENSE.emb, reduce_scatter_embeddings=sp)
        self.norm = nn.LayerNorm(HIDDEN)
        self.norm.load_state_dict(DENSE.norm.state_dict())
        if sp:
            mark_sequence_parallel(self.norm)
        self.up = ColumnParallelLinear.from_dense(DENSE.up, sequence_parallel=sp)
        self.down = RowParallelLinear.from_dense(DENSE.down, sequence_parallel=sp)
        self.head = ColumnParallelLinear.from_dense(DENSE.head, sequence_parallel=sp)

    def forward(self, tokens):
        x = self.emb(tokens)  # [B, T, C] (or [B, T / tp, C] under SP)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x)  # [B, T, V / tp]


def test_ddp_under_bf16_autocast_equals_the_single_thread_recipe():
    want_loss, want = dense_recipe()

    def body():
        coords, dp = threadpar.get_coords(), threadpar.get_layout().dp
        model = TinyLM()
        model.load_state_dict(DENSE.state_dict())
        ddp = DistributedDataParallel(model)
        per = TOKENS.shape[0] // dp
        rows = slice(coords.dp * per, (coords.dp + 1) * per)
        with torch.autocast("cpu", dtype=BF16):
            logits = ddp(TOKENS[rows])
            loss = F.cross_entropy(logits.flatten(0, 1), TARGETS[rows].flatten())
        loss.backward()
        threadpar.all_reduce(loss.detach(), op="avg", group="DP")
        return logits.dtype, loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    for dtype, loss, grads in run_ranks(body, 4, dp=4):
        assert dtype == BF16
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert all(g.dtype == torch.float32 for g in grads.values()), "fp32 weights keep fp32 gradients"
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("sp", [False, True])
def test_tp_layers_under_bf16_autocast_equal_the_single_thread_recipe(sp):
    """dp=2 x tp=2: the vocab-parallel loss on bf16 logits, SP's reduce-scatter/all-gather in bf16."""
    want_loss, want = dense_recipe()

    def body():
        coords, dp = threadpar.get_coords(), threadpar.get_layout().dp
        model = ParallelLM(sp)
        ddp = DistributedDataParallel(model)
        per = TOKENS.shape[0] // dp
        rows = slice(coords.dp * per, (coords.dp + 1) * per)
        with torch.autocast("cpu", dtype=BF16):
            logits = ddp(TOKENS[rows])
            loss = vocab_parallel_cross_entropy(logits, TARGETS[rows])
        loss.backward()
        if sp:
            allreduce_sequence_parallel_grads(model)
        threadpar.all_reduce(loss.detach(), op="avg", group="DP")
        return logits.dtype, loss.detach(), gather_dense_grads(model)

    for dtype, loss, grads in run_ranks(body, 4, dp=2, tp=2):
        assert dtype == BF16
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert set(grads) == set(want)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def stack_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)])


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])  # zbh1: a split backward (B, then W) of that graph
def test_pipeline_autocast_dtype_runs_every_chunk_and_the_loss_under_autocast(schedule):
    dense = stack_model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    reference = stack_model()
    reference.load_state_dict(dense.state_dict())
    with torch.autocast("cpu", dtype=BF16):
        # the pipeline's loss: the mean of the microbatch losses (2 equal microbatches)
        want_loss = torch.stack([F.mse_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2))]).mean()
    want_loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}

    def body():
        model = stack_model()
        model.load_state_dict(dense.state_dict())
        stage, pp = threadpar.get_coords().pp, threadpar.get_layout().pp
        chunks = build_chunks(list(model), pp_size=pp, pp_rank=stage)
        seen = []
        chunks[0].register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
        pipe = PipelineParallel(
            chunks, loss_fn=F.mse_loss, schedule=schedule, num_microbatches=2, autocast_dtype=BF16
        )
        loss = pipe.train_step(x, y)
        return stage, seen, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    grads = {}
    for stage, seen, loss, rank_grads in run_ranks(body, 2, pp=2):
        torch.testing.assert_close(loss, want_loss.float(), **TOL)
        first_input = torch.float32 if stage == 0 else BF16  # what travelled from stage 0 is bf16
        assert seen == [(first_input, BF16)] * 2, seen
        grads.update(rank_grads)
    assert set(grads) == set(want)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_pipeline_refuses_an_autocast_dtype_it_cannot_use():
    def body():
        with pytest.raises(threadpar.ConfigError, match=r"pass torch\.bfloat16 or torch\.float16"):
            PipelineParallel(
                nn.Linear(2, 2), loss_fn=F.mse_loss, num_microbatches=1, autocast_dtype=torch.float32
            )

    run_ranks(body, 1)
