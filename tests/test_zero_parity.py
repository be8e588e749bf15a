"""ZeroRedundancyOptimizer (ZeRO-1/2) under DDP against one thread on the whole batch: parameters and the
dense optimizer state after 3 steps, state bytes per rank, gradient accumulation, resuming across dp."""

import pytest
import torch
from helpers.ddp_reference import assert_same, batches, mlp
from helpers.zero_reference import assert_same_state, plain, reference, zero, zero_run

OPTIMIZERS = [torch.optim.AdamW, torch.optim.SGD]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0])
def test_zero_matches_one_thread_after_three_steps(stage, world, cls, bucket_cap_mb):
    template = mlp()
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    expected, expected_state, _ = reference(template, data, plain(cls))
    caps = dict(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb)
    for params, state, _ in zero_run(template, data, zero(cls, stage), world, **caps):
        assert_same(params, expected, f"parameters (stage {stage})")
        assert_same_state(state, expected_state, f"state_dict (stage {stage})")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_state_per_rank_is_one_dp_th_of_the_dense_state(stage, world):
    template = mlp(widths=(6, 64, 64, 3))  # 4.8k parameters: the scalar `step`s are 0.03% of the state
    data = batches(steps=1, rows=8, n_in=6, n_out=3)
    _, _, dense_bytes = reference(template, data, plain(torch.optim.AdamW))
    per_rank = [nbytes for _, _, nbytes in zero_run(template, data, zero(torch.optim.AdamW, stage), world)]
    for nbytes in per_rank:
        assert abs(nbytes / dense_bytes - 1 / world) < 0.005, (per_rank, dense_bytes)
    assert sum(per_rank) >= dense_bytes  # every element's state is somewhere


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_with_no_sync(stage):
    template = mlp()
    data = batches(steps=3, rows=16, n_in=6, n_out=3)
    expected, _, _ = reference(template, data, plain(torch.optim.AdamW))
    for params, _, _ in zero_run(template, data, zero(torch.optim.AdamW, stage), 2, accumulate=2):
        assert_same(params, expected, "parameters")


@pytest.mark.parametrize(
    ("stage", "resume_world", "resume_stage"), [(1, 2, 2), (2, 2, 1), (1, 1, 0), (2, 4, 1)]
)
def test_state_saved_on_dp_4_resumes_on_another_dp_or_without_zero(stage, resume_world, resume_stage):
    """3 steps with ZeRO on dp=4, then its state_dict into a fresh optimizer on another dp (or a plain
    AdamW on one thread) for 2 more: the parameters equal 5 uninterrupted steps on one thread."""
    template = mlp()
    data = batches(steps=5, rows=8, n_in=6, n_out=3)
    expected, _, _ = reference(template, data, plain(torch.optim.AdamW))
    saved_params, saved_state, _ = zero_run(template, data[:3], zero(torch.optim.AdamW, stage), 4)[0]
    if resume_stage == 0:
        template.load_state_dict(saved_params)
        resumed, _, _ = reference(template, data[3:], plain(torch.optim.AdamW), state=saved_state)
        assert_same(resumed, expected, "parameters resumed without ZeRO")
        return
    make = zero(torch.optim.AdamW, resume_stage)
    for params, _, _ in zero_run(
        template, data[3:], make, resume_world, state=saved_state, start=saved_params
    ):
        assert_same(params, expected, f"parameters resumed on dp={resume_world}")


def test_a_plain_optimizers_state_loads_into_zero():
    template = mlp()
    data = batches(steps=5, rows=8, n_in=6, n_out=3)
    expected, _, _ = reference(template, data, plain(torch.optim.AdamW))
    first_params, first_state, _ = reference(template, data[:3], plain(torch.optim.AdamW))
    make = zero(torch.optim.AdamW, 2)
    for params, _, _ in zero_run(template, data[3:], make, 2, state=first_state, start=first_params):
        assert_same(params, expected, "parameters")
