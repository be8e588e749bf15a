"""The GPT with context parallelism (ring attention) and MoE blocks (experts over EP groups): a step's loss,
including the MoE aux losses, and every gradient equal the single-thread model's."""

from dataclasses import replace

import pytest
import torch
from helpers.gpt_reference import SMALL, Reference, check_against, dp_slice, hybrid_step, reference

import threadpar
from threadpar.models.gpt import GPT, TensorParallel
from threadpar.models.parallelize_gpt import parallelize_chunk, parallelize_gpt
from threadpar.parallel import gather_sequence, split_sequence
from threadpar.testing import run_ranks

MOE = replace(SMALL, n_layer=4, moe_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.1)


@pytest.fixture(scope="module")
def ref():
    return reference()


# (dp, cp, tp, pp, sequence parallel, schedule)
CP_CASES = [
    (1, 2, 1, 1, False, "1f1b"),
    (2, 2, 2, 1, False, "1f1b"),
    (1, 2, 2, 2, True, "1f1b"),
    (2, 2, 1, 2, False, "interleaved"),
    (1, 4, 2, 1, False, "1f1b"),
]


@pytest.mark.parametrize(("dp", "cp", "tp", "pp", "sp", "schedule"), CP_CASES)
def test_context_parallel_gpt_step_equals_single_thread_step(ref, dp, cp, tp, pp, sp, schedule):
    microbatches = 2 * pp
    world = dp * cp * tp * pp
    results = run_ranks(
        hybrid_step,
        world,
        ref,
        schedule,
        microbatches,
        kwargs={"sequence_parallel": sp},
        dp=dp,
        cp=cp,
        tp=tp,
        pp=pp,
    )
    check_against(ref, results)


def test_context_parallel_gpt_computes_the_plain_logits():
    """parallelize_chunk(GPT(config), cp=..., tp=...) alone: this rank's part of the sequence in, its part of the logits out."""
    config = replace(SMALL, n_layer=2)
    plain = GPT(config).init_weights(torch.Generator().manual_seed(1))
    idx = torch.randint(0, 256, (2, config.block_size), generator=torch.Generator().manual_seed(2))
    expected = plain(idx)

    def body():
        cp = threadpar.get_group("CP")
        model = parallelize_chunk(GPT(config), tp=TensorParallel(group=threadpar.get_group("TP")), cp=cp)
        model.load_state_dict(plain.state_dict())
        logits = model(split_sequence(idx, dim=1))  # [B, T / cp, V / tp]
        gathered = [torch.empty_like(logits) for _ in range(2)]
        threadpar.all_gather(gathered, logits.contiguous(), group="TP")
        return gather_sequence(torch.cat(gathered, dim=-1), dim=1)

    for logits in run_ranks(body, 4, cp=2, tp=2):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def moe_reference(config, dp: int, microbatches: int, batch: int = 16) -> tuple[Reference, float]:
    """The single-thread MoE GPT on the same token sets as the parallel step: one forward per (DP replica,
    microbatch), gradients of the mean loss (cross-entropy + aux) accumulated. Also returns the mean aux."""
    g = torch.Generator().manual_seed(0)
    model = GPT(config).init_weights(g)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    loss = model.accumulate_gradients(inputs, targets, forwards=dp * microbatches)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    aux = float(model.aux_loss_sum) / (dp * microbatches)  # (a device tensor: read here)
    return Reference(config, dense, inputs, targets, loss, grads), aux


def moe_step(ref, schedule, microbatches, **options):
    """hybrid_step that also returns the aux part of the loss: (loss, aux) averaged over DP, dense grads."""
    layout, coords = threadpar.get_layout(), threadpar.get_coords()
    model = parallelize_gpt(
        ref.config, ref.dense, schedule=schedule, num_microbatches=microbatches, **options
    )
    loss = model.train_step(
        dp_slice(ref.inputs, coords.dp, layout.dp), dp_slice(ref.targets, coords.dp, layout.dp)
    )
    parts = torch.stack([loss, torch.tensor(model.last_aux_loss)])
    threadpar.all_reduce(parts, op="avg", group="DP")
    return parts, model.dense_grads()


# (dp, ep, cp, tp, pp, sequence parallel, schedule, capacity factor)
MOE_CASES = [
    (2, 2, 1, 1, 1, False, "1f1b", None),
    (2, 2, 1, 1, 1, False, "1f1b", 1.0),  # with dropped tokens: decided per forward, as on one thread
    (4, 2, 1, 1, 2, False, "1f1b", 1.0),  # the experts' gradients are reduced over expert-DP groups of 2
    (2, 2, 2, 2, 1, True, "1f1b", None),  # routing counted over CP x TP (sequence parallel)
    (2, 2, 2, 1, 2, False, "interleaved", None),
]


@pytest.mark.parametrize(("dp", "ep", "cp", "tp", "pp", "sp", "schedule", "capacity"), MOE_CASES)
def test_moe_gpt_step_equals_single_thread_moe_gpt(dp, ep, cp, tp, pp, sp, schedule, capacity):
    microbatches = 2 * pp
    config = replace(MOE, moe_capacity_factor=capacity)
    ref, want_aux = moe_reference(config, dp, microbatches)
    assert want_aux > 0.05  # coeff 0.1 times a near-uniform routing: a real part of the loss
    results = run_ranks(
        moe_step, dp * cp * tp * pp, ref, schedule, microbatches,
        kwargs={"ep": ep, "sequence_parallel": sp}, dp=dp, cp=cp, tp=tp, pp=pp,
    )  # fmt: skip
    for parts, _ in results:
        torch.testing.assert_close(parts[1].item(), want_aux, rtol=1e-5, atol=1e-7)
    check_against(ref, [(parts[0], grads) for parts, grads in results])  # the loss includes the aux


def test_moe_gpt_refuses_ep_without_experts_and_uneven_sequences():
    def body():
        with pytest.raises(threadpar.ConfigError, match="ep=2 needs a MoE model"):
            parallelize_gpt(SMALL, GPT(SMALL).state_dict(), ep=2)
        model = parallelize_gpt(SMALL, GPT(SMALL).state_dict())
        idx = torch.zeros(2, 6, dtype=torch.int64)
        with pytest.raises(threadpar.ConfigError, match="must be a multiple of 4"):
            model.train_step(idx, idx)

    run_ranks(body, 2, cp=2)
