"""The GPU tier (`pytest -m cuda`): collectives, DDP, TP and pipeline parity on real GPUs with the nccl backend.

Each test runs what a CPU test runs, on every visible GPU (one rank thread each), against the same oracle:
the threads backend for collectives, the single-thread model for DDP, TP and the pipeline. Skipped (with the
reason) on machines without GPUs; tests/conftest.py does that for every test marked `cuda`.
"""

from __future__ import annotations

import pytest
import torch
from helpers.ddp_reference import adam, assert_same, batches, ddp_run, mlp, reference_run
from helpers.gpt_reference import SMALL, check_against, hybrid_step, reference
from helpers.gpus import GPU_TIMEOUT_S, gpus_or_skip, run_gpus

from threadpar import selftest
from threadpar.selftest_models import check_models
from threadpar.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]


def nccl(n):
    return lambda fn, **layout: run_gpus(fn, n, **layout)


def threads(n):
    return lambda fn, **layout: run_ranks(fn, n, timeout=GPU_TIMEOUT_S, **layout)


def test_every_collective_matches_the_threads_backend():
    # Roots on the last rank, AVG on 3 ranks, sub-groups, last <-> first: what torch.cuda.nccl gets wrong
    # when called naively (issue 14). Sizes: one small, one past NCCL's small-message protocols.
    n = gpus_or_skip(2)
    rows = selftest.check(nccl(n), threads(n), n, [4 << 10, 4 << 20], 3)
    failed = [r for r in rows if r[2] != "pass"]
    assert not failed, failed


def test_the_model_steps_match_the_threads_backend():
    """DDP, ZeRO-2, fp16 autocast + LossScaler, 1F1B and zbh1 pipeline steps (threadpar.selftest_models)."""
    n = gpus_or_skip(2)
    rows = check_models(nccl(n), threads(n), n)
    assert [r[2] for r in rows] == ["pass"] * len(rows) and len(rows) == 5, rows


def test_ddp_over_every_gpu_matches_one_thread_on_the_whole_batch():
    n = gpus_or_skip(2)
    template, data = mlp(), batches(3, 4 * n, 6, 3)
    want_grads, want_params = reference_run(template, data, adam)
    for grads, params in ddp_run(template, data, adam, n, runner=lambda body, world: run_gpus(body, world)):
        assert_same(grads, want_grads, "first-step gradient")
        assert_same(params, want_params, "final parameter")


def layouts(n: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) over n GPUs that the SMALL GPT splits into: TP only, PP only, and the mixes."""
    found = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if n % (tp * pp) == 0 and SMALL.n_head % tp == 0 and SMALL.n_layer % pp == 0:
                found.append((n // (tp * pp), tp, pp))
    return found


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("which", ["tp", "pp", "mixed"])
def test_gpt_step_under_tp_and_pp_matches_the_single_thread_model(ref, which):
    n = gpus_or_skip(2)
    pick = {
        "tp": [lay for lay in layouts(n) if lay[1] > 1 and lay[2] == 1],
        "pp": [lay for lay in layouts(n) if lay[2] > 1 and lay[1] == 1],
        "mixed": [lay for lay in layouts(n) if sum(size > 1 for size in lay) >= 2],
    }[which]
    if not pick:
        pytest.skip(f"no {which} layout of the SMALL GPT over {n} GPUs")
    dp, tp, pp = max(pick, key=lambda lay: lay[1] * lay[2])
    microbatches = 2 * pp if pp > 1 else 2
    results = run_gpus(hybrid_step, n, ref, "1f1b", microbatches, dp=dp, tp=tp, pp=pp)
    # cuBLAS sums in another order than the CPU reference: fp32 parity at a slightly wider tolerance.
    check_against(ref, results, rtol=1e-3, atol=1e-5)


def test_the_sequence_parallel_gpt_step_matches_the_single_thread_model(ref):
    n = gpus_or_skip(2)
    tp = max(t for t in (2, 4, 8) if n % t == 0 and SMALL.n_head % t == 0)
    results = run_gpus(hybrid_step, n, ref, "1f1b", 2, kwargs={"sequence_parallel": True}, dp=n // tp, tp=tp)
    check_against(ref, results, rtol=1e-3, atol=1e-5)


def test_the_tensors_live_on_the_ranks_gpus():
    n = gpus_or_skip(1)

    def where():
        import threadpar

        t = torch.zeros(1, device=threadpar.get_device())
        threadpar.all_reduce(t)
        return str(t.device)

    assert run_gpus(where, n) == [f"cuda:{i}" for i in range(n)]
