"""ZeroRedundancyOptimizer (ZeRO-1/2) under DDP: parameters after 3 steps equal one thread's."""

import pytest
from ddp_reference import assert_same, batches, mlp, reference_run
from zero_reference import ZERO, zero_run


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0])
def test_zero_matches_one_thread_after_three_steps(stage, world, optimizer, bucket_cap_mb):
    template = mlp()
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    plain, zero = ZERO[optimizer]
    _, expected = reference_run(template, data, plain)
    for params, _, _ in zero_run(
        template, data, zero, stage, world, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb
    ):
        assert_same(params, expected, f"parameters (stage {stage})")
