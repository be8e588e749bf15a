"""clip_grad_norm_ with user models (DDP, TP layers, plain pipeline stages), its errors, and the
lower-level total_grad_norm that a sharded optimizer uses."""

import math

import pytest
import torch
from torch import nn

import threadpar
from threadpar.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    GradPlacement,
    RowParallelLinear,
    clip_grad_norm_,
    grad_placements,
    mark_grad_placements,
    total_grad_norm,
)
from threadpar.testing import run_ranks

# Each test runs with the double running NCCL operations once issued and lazily (conftest.fake_mode).
pytestmark = pytest.mark.usefixtures("fake_mode")

DENSE = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
X = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))


def dense_clipped(max_norm, norm_type):
    model = nn.Sequential(*[m for m in DENSE])  # the same parameters: clone below keeps DENSE intact
    grads = torch.autograd.grad(model(X).square().mean(), list(model.parameters()))
    params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total, [p.grad for p in params]


def tp_mlp():
    """DENSE split over TP (column, row) with its LayerNorm replicated, wrapped in DDP over DP."""
    column = ColumnParallelLinear.from_dense(DENSE[0])
    row = RowParallelLinear.from_dense(DENSE[2])
    norm = nn.LayerNorm(8)
    norm.load_state_dict(DENSE[3].state_dict())
    return nn.Sequential(column, nn.GELU(), row, norm)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_ddp_over_tp_layers_and_a_replicated_layer_norm_clip_like_the_dense_model(norm_type):
    want_total, want_grads = dense_clipped(0.05, norm_type)

    def body():
        coords, layout = threadpar.get_coords(), threadpar.get_layout()
        model = DistributedDataParallel(tp_mlp())
        per = X.shape[0] // layout.dp
        model(X[coords.dp * per : (coords.dp + 1) * per]).square().mean().backward()
        total = clip_grad_norm_(model.parameters(), 0.05, norm_type)
        inner = model.module
        # Dense gradients back from the shards: column weight/bias by rows, row weight by columns.
        tp = threadpar.get_group("TP")
        parts = []
        for shard, dim in ((inner[0].weight, 0), (inner[0].bias, 0), (inner[2].weight, 1)):
            pieces = [torch.empty_like(shard.grad) for _ in range(tp.size())]
            tp.all_gather(pieces, shard.grad.contiguous())
            parts.append(torch.cat(pieces, dim=dim))
        return total, [*parts, inner[2].bias.grad, inner[3].weight.grad, inner[3].bias.grad]

    for total, grads in run_ranks(body, 4, dp=2, tp=2):
        torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-7)
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_outside_a_launch_it_is_torchs_clip_grad_norm():
    want_total, want_grads = dense_clipped(0.05, 2.0)
    model = nn.Sequential(*[m for m in DENSE])
    params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    grads = torch.autograd.grad(model(X).square().mean(), list(model.parameters()))
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.testing.assert_close(clip_grad_norm_(params, 0.05), want_total)
    for p, want in zip(params, want_grads):
        torch.testing.assert_close(p.grad, want)


def test_pipeline_stages_need_no_marker_and_a_rank_without_gradients_still_takes_part():
    """pp=4, each stage one distinct Linear: the norm is over all four; stage 3 has no gradients at all."""
    weights = [torch.randn(3, 3, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in weights[:3]]))

    def body():
        stage = threadpar.get_coords().pp
        param = nn.Parameter(torch.zeros(3, 3))
        if stage < 3:
            param.grad = weights[stage].clone()
        return clip_grad_norm_([param], 1e9)

    for total in run_ranks(body, 4, pp=4):
        torch.testing.assert_close(total, want)


@pytest.mark.parametrize(("bad", "norm_type"), [(math.inf, 2.0), (math.nan, 2.0), (math.nan, math.inf)])
def test_a_non_finite_norm_raises_on_every_rank_together(bad, norm_type):
    """Only rank 2's gradient is bad; every rank sees the reduced norm and raises the same error."""

    def body():
        param = nn.Parameter(torch.zeros(4))
        param.grad = torch.ones(4)
        if threadpar.get_rank() == 2:
            param.grad[1] = bad
        with pytest.raises(RuntimeError, match=r"is non-finite .* on every rank"):
            clip_grad_norm_([param], 1.0, norm_type, error_if_nonfinite=True)
        total = clip_grad_norm_([param], 1.0, norm_type)  # without the flag: the non-finite norm itself
        return total.item(), param.grad.clone()

    for total, _ in run_ranks(body, 4, pp=4):
        assert math.isnan(total) or (math.isinf(total) and not math.isnan(bad))


def test_a_parameter_whose_layout_is_unknown_is_named_with_how_to_mark_it():
    def body():
        plain = nn.Linear(4, 4)  # under tp=2 with no marker: a shard or a copy? nobody recorded it
        plain(torch.ones(1, 4)).sum().backward()
        with pytest.raises(
            threadpar.ConfigError, match=r"parameter #0 \(shape \[4, 4\].*mark_grad_placements"
        ):
            clip_grad_norm_(plain.parameters(), 1.0)
        mark_grad_placements(plain)  # now: replicated over TP (and DP), counted once
        return clip_grad_norm_(plain.parameters(), 1e9)

    want = torch.nn.utils.get_total_norm([torch.ones(4, 4), torch.ones(4)])
    for total in run_ranks(body, 4, dp=2, tp=2):
        torch.testing.assert_close(total, want)


def test_bad_arguments_are_refused_before_any_collective():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    for norm_type in (0, -1.0, -math.inf, "two", math.nan):
        with pytest.raises(threadpar.ConfigError, match="norm_type"):
            clip_grad_norm_([param], 1.0, norm_type)
    with pytest.raises(threadpar.ConfigError, match="max_norm"):
        clip_grad_norm_([param], -1.0)
    with pytest.raises(threadpar.ConfigError, match="2 gradients but 1 placements"):
        total_grad_norm([param.grad, param.grad], [GradPlacement()])


def test_total_grad_norm_of_shards_over_dp_equals_the_norm_of_the_reduced_gradient():
    """What a ZeRO-2 optimizer has: each DP rank 1/dp of the reduced gradient of a TP-replicated tensor."""
    full = torch.arange(16.0)
    want = torch.linalg.vector_norm(full)

    def body():
        replicated = nn.Parameter(torch.zeros(16))
        mark_grad_placements(nn.ParameterList([replicated]))
        (placement,) = grad_placements([replicated])
        shard = full.chunk(threadpar.get_layout().dp)[threadpar.get_coords().dp]
        return total_grad_norm([shard], [placement.sharded_over_data_parallel()])

    for total in run_ranks(body, 8, dp=4, tp=2):
        torch.testing.assert_close(total, want)


def test_ddp_leaves_a_layer_over_an_unknown_group_unmarked_and_clipping_names_it():
    """A ColumnParallelLinear over a group that is not the layout's TP group: which ranks hold copies of
    its shards is unknown, so DDP marks it not and clip_grad_norm_ refuses it by name."""

    def body():
        pair = threadpar.new_group([0, 1]) if threadpar.get_rank() < 2 else threadpar.new_group([2, 3])
        layer = ColumnParallelLinear(4, 4, group=pair)
        model = DistributedDataParallel(
            nn.Sequential(layer),
            process_group=threadpar.new_group([0, 2])
            if threadpar.get_rank() in (0, 2)
            else threadpar.new_group([1, 3]),
        )
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(
            threadpar.ConfigError,
            match=r"parameter #0 \(shape \[2, 4\], torch.float32\) has no gradient placement.*mark_grad_placement\(param",
        ):
            clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(threadpar.ConfigError, match="not this rank's TP group"):
            mark_grad_placements(model.module)

    run_ranks(body, 4, dp=4)


def test_experts_over_ep_without_their_expert_dp_group_are_refused():
    from threadpar.parallel import MoE, MoEConfig, expert_parallel_groups

    def body():
        ep_group, _ = expert_parallel_groups(2)
        moe = MoE(MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4, top_k=2), ep_group)
        with pytest.raises(
            threadpar.ConfigError, match=r"expert_data_parallel=expert_parallel_groups\(ep\)\[1\]"
        ):
            mark_grad_placements(moe)

    run_ranks(body, 4, dp=4)


def test_on_the_nccl_backend_the_norm_and_the_clip_equal_the_dense_model():
    """Over the CUDA/NCCL test double: the all-reduce is stream-ordered, and the clip reads its result."""
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
    from fakes.sim_gpu import to_host

    want_total, want_grads = dense_clipped(0.05, 2.0)

    def body():
        device = threadpar.get_device()
        model = DistributedDataParallel(tp_mlp().to(device))
        per = X.shape[0] // 2
        dp = threadpar.get_coords().dp
        model(X[dp * per : (dp + 1) * per].to(device)).square().mean().backward()
        total = clip_grad_norm_(model.parameters(), 0.05, error_if_nonfinite=True)
        inner = model.module
        return total, [inner[2].bias.grad, inner[3].weight.grad, inner[3].bias.grad]

    for total, grads in to_host(run_fake_gpus(body, 4, FakeCuda(), dp=2, tp=2)):
        torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-7)
        for got, want in zip(grads, want_grads[3:]):  # the replicated ones: row bias, LayerNorm
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
