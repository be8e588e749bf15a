"""The GPT under DP x TP x PP: a step's loss and every gradient equal the single-thread model's."""

import pytest
import torch
from helpers.gpt_reference import SMALL, check_against, hybrid_step, reference

import threadpar
from threadpar.demo.memory import SavedActivationTracker
from threadpar.models.gpt import GPT, GPTConfig, TensorParallel
from threadpar.models.parallelize_gpt import parallelize_chunk
from threadpar.testing import run_ranks

LAYOUTS = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 8, 1)]
# Interleaving needs a pipeline: 1F1B on every layout, interleaved on those with pp > 1.
CASES = [(*layout, "1f1b") for layout in LAYOUTS] + [
    (*layout, "interleaved") for layout in LAYOUTS if layout[2] > 1
]


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize(("dp", "tp", "pp", "schedule"), CASES)
def test_hybrid_step_equals_single_thread_model(ref, dp, tp, pp, schedule):
    microbatches = 2 * pp if pp > 1 else 2
    results = run_ranks(hybrid_step, 8, ref, schedule, microbatches, dp=dp, tp=tp, pp=pp)
    check_against(ref, results)


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (1, 4, 2)])
def test_sequence_parallel_hybrid_step(ref, dp, tp, pp):
    results = run_ranks(
        hybrid_step, 8, ref, "1f1b", 2 * pp, kwargs={"sequence_parallel": True}, dp=dp, tp=tp, pp=pp
    )
    check_against(ref, results)


def test_bf16_autocast_matches_the_single_thread_model_under_the_same_autocast():
    ref = reference(autocast=torch.bfloat16)
    results = run_ranks(
        hybrid_step, 8, ref, "1f1b", 4, kwargs={"autocast_dtype": torch.bfloat16}, dp=2, tp=2, pp=2
    )
    for _, grads in results:
        assert all(g.dtype == torch.float32 for g in grads.values()), "master weights and grads stay fp32"
    # bf16 rounds differently when the matmuls are split, so the comparison is at bf16 precision.
    check_against(ref, results, rtol=2e-2, atol=2e-3)


def test_recompute_gives_the_same_gradients_and_saves_activation_memory(ref):
    def step(recompute):
        tracker = SavedActivationTracker()
        with tracker.track():
            loss, grads = hybrid_step(ref, "1f1b", 4, recompute=recompute)
        return loss, grads, tracker.peak

    plain = run_ranks(step, 4, False, dp=1, tp=2, pp=2)
    recomputed = run_ranks(step, 4, True, dp=1, tp=2, pp=2)
    check_against(ref, [(loss, grads) for loss, grads, _ in recomputed])
    for (_, _, before), (_, _, after) in zip(plain, recomputed):
        assert after < 0.6 * before, (before, after)


def test_tensor_parallel_gpt_matches_the_plain_model_module_by_module():
    """parallelize_chunk(GPT(config), tp=...) alone (no pipeline, no DDP) computes the plain model's logits."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8)
    plain = GPT(config).init_weights(torch.Generator().manual_seed(3))
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    expected = plain(idx)

    def body(sp):
        tp = TensorParallel(group=threadpar.get_group("TP"), sequence_parallel=sp)
        model = parallelize_chunk(GPT(config), tp=tp)
        model.load_state_dict(plain.state_dict())
        logits = model(idx)  # [B, T, V / tp]
        gathered = [torch.empty_like(logits) for _ in range(tp.size)]
        threadpar.all_gather(gathered, logits.contiguous(), group="TP")
        return torch.cat(gathered, dim=-1)

    for sp in (False, True):
        for logits in run_ranks(body, 4, sp, tp=4):
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_chunk_parameter_names_are_the_dense_model_names():
    from threadpar.models.gpt import GPTChunk

    dense = set(GPT(SMALL).state_dict())
    first = GPTChunk(SMALL, range(0, 3), first=True, last=False)
    last = GPTChunk(SMALL, range(3, 8), first=False, last=True)
    assert set(first.state_dict()) | set(last.state_dict()) == dense
    assert not set(first.state_dict()) & set(last.state_dict())


def test_bad_model_settings_are_explained():
    with pytest.raises(threadpar.ConfigError, match="n_embd=30 must be divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)

    def body():
        with pytest.raises(threadpar.ConfigError, match="n_head=4 is not divisible by tp=8"):
            parallelize_chunk(GPT(GPTConfig(n_head=4)), tp=TensorParallel(group=threadpar.get_group("TP")))

    run_ranks(body, 8, tp=8)
