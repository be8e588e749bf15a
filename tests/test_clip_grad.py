"""clip_grad_norm_ over DP x CP x TP (SP) x PP and MoE experts over EP: the total norm and the clipped
gradients equal torch.nn.utils.clip_grad_norm_ on the single-thread model's gradients, for norms 2, 1, inf."""

import pytest
import torch
from helpers.gpt_reference import SMALL, dp_slice, reference
from test_gpt_cp_moe import MOE, moe_reference

import threadpar
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import clip_grad_norm_
from threadpar.testing import run_ranks

NORM_TYPES = (2.0, 1.0, float("inf"))

# (dp, cp, tp, pp, sequence parallel, schedule, ep); ep > 1 runs the MoE GPT.
CASES = [
    (8, 1, 1, 1, False, "1f1b", 1),
    (4, 1, 2, 1, False, "1f1b", 1),
    (2, 1, 2, 2, False, "1f1b", 1),
    (1, 1, 2, 4, False, "1f1b", 1),
    (2, 1, 1, 4, False, "interleaved", 1),
    (1, 1, 8, 1, False, "1f1b", 1),
    (2, 1, 2, 2, True, "1f1b", 1),  # SP: norms and row biases replicated over TP, summed before clipping
    (2, 2, 2, 1, False, "1f1b", 1),  # CP: DDP over DP x CP
    (1, 2, 2, 2, True, "1f1b", 1),
    (4, 1, 1, 1, False, "1f1b", 2),  # experts over EP groups of 2, the same experts on expert-DP pairs
    (2, 2, 2, 1, True, "1f1b", 2),  # experts: expert-DP over DP x CP; routing over CP x TP
]


def torch_clip(grads: dict[str, torch.Tensor], max_norm: float, norm_type: float):
    """torch's clip_grad_norm_ on the dense model's gradients: (total norm, clipped gradients)."""
    params = {name: torch.nn.Parameter(torch.zeros_like(g)) for name, g in grads.items()}
    for name, p in params.items():
        p.grad = grads[name].clone()
    total = torch.nn.utils.clip_grad_norm_(params.values(), max_norm, norm_type)
    return total, {name: p.grad for name, p in params.items()}


def clipped_step(ref, schedule, microbatches, max_norms, **options):
    """One step of this rank's part; then, from the same gradients, clip for each norm type.
    Returns [(total norm, this stage's dense clipped gradients)] per norm type."""
    layout, coords = threadpar.get_layout(), threadpar.get_coords()
    model = parallelize_gpt(
        ref.config, ref.dense, schedule=schedule, num_microbatches=microbatches, **options
    )
    model.train_step(dp_slice(ref.inputs, coords.dp, layout.dp), dp_slice(ref.targets, coords.dp, layout.dp))
    params = list(model.parameters())
    reduced = [p.grad.clone() for p in params]
    results = []
    for norm_type, max_norm in zip(NORM_TYPES, max_norms):
        for p, g in zip(params, reduced):
            p.grad.copy_(g)
        total = clip_grad_norm_(params, max_norm, norm_type)
        results.append((total, model.dense_grads()))
    return results


@pytest.mark.parametrize(("dp", "cp", "tp", "pp", "sp", "schedule", "ep"), CASES)
def test_clip_grad_norm_equals_torch_on_the_dense_model(dp, cp, tp, pp, sp, schedule, ep):
    microbatches = 2 * pp
    if ep > 1:
        ref, _ = moe_reference(MOE, dp, microbatches)
    else:
        ref = reference(SMALL)
    # Half the unclipped norm, so that every norm type really scales the gradients.
    max_norms = [0.5 * float(torch.nn.utils.get_total_norm(list(ref.grads.values()), p)) for p in NORM_TYPES]
    results = run_ranks(
        clipped_step, dp * cp * tp * pp, ref, schedule, microbatches, max_norms,
        kwargs={"sequence_parallel": sp, "ep": ep}, dp=dp, cp=cp, tp=tp, pp=pp,
    )  # fmt: skip
    for index, (norm_type, max_norm) in enumerate(zip(NORM_TYPES, max_norms)):
        want_total, want_grads = torch_clip(ref.grads, max_norm, norm_type)
        covered = set()
        for rank_results in results:
            total, grads = rank_results[index]
            torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-7)
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad,
                    want_grads[name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, n=name, p=norm_type: f"p={p} {n}: {m}",
                )
                covered.add(name)
        assert covered == set(ref.grads)
