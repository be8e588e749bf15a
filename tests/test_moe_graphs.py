"""MoE in a CUDA graph (issue 33): MoEConfig(pad_to_capacity=True) gives every expert a fixed number of slots,
so nothing in the layer's forward or backward depends on the routing's counts. Padded against unpadded at the
same capacity (one thread, ep = 2), which slots `assign_slots` fills, graphed against eager steps on the
CUDA/NCCL double (ep = 1 and 2, an aux loss counted over a CP group), and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from helpers.tp_parity import assert_grads_close, grads_of, randn
from test_cuda_graphs import assert_graphed_equals_eager, graphed_and_eager

import threadpar
from threadpar import GraphCaptureError
from threadpar.errors import ConfigError
from threadpar.parallel import (
    DistributedDataParallel,
    MoE,
    MoEConfig,
    expert_parallel_groups,
    gather_dense_grads,
)
from threadpar.parallel.expert_parallel.routing import assign, assign_slots, expert_capacity
from threadpar.testing import run_ranks

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("fake_mode")]

HIDDEN, FFN, TOKENS = 8, 16, 12


def config(**overrides) -> MoEConfig:
    fields = {"hidden_size": HIDDEN, "ffn_hidden_size": FFN, "num_experts": 4, "capacity_factor": 0.75}
    return MoEConfig(**{**fields, **overrides})


def padded_pair(cfg: MoEConfig, seed: int = 0, skew: float = 0.0) -> tuple[MoE, MoE]:
    """(unpadded, padded) MoE layers with the same weights; `skew` pulls the router towards expert 0."""
    unpadded = MoE(cfg, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        unpadded.router.weight[0] += skew
    padded = MoE(MoEConfig(**{**vars(cfg), "pad_to_capacity": True}))
    padded.load_state_dict(unpadded.state_dict())
    return unpadded, padded


def forward_backward(moe: MoE, x: torch.Tensor, w: torch.Tensor):
    """(y, x's gradient, the parameters' gradients, the stats as numbers) of loss sum(y * w) (+ the aux loss)."""
    xi = x.clone().requires_grad_()
    y = moe(xi)
    (y * w).sum().backward()
    s = moe.last_stats
    numbers = (s.kept.tolist(), s.routed.tolist(), s.capacity, s.dropped, s.dropped_tokens, s.aux_loss)
    return y.detach(), xi.grad, grads_of(moe), numbers


def test_pad_to_capacity_needs_a_capacity_factor_and_says_so():
    with pytest.raises(
        ConfigError, match=r"pad_to_capacity=True needs a capacity_factor.*capacity_factor \(1.0"
    ):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, pad_to_capacity=True)
    with pytest.raises(ConfigError, match="pad_to_capacity must be a bool"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, capacity_factor=1.0, pad_to_capacity=1)
    cfg = MoEConfig(
        hidden_size=8, ffn_hidden_size=8, num_experts=4, capacity_factor=1.0, pad_to_capacity=True
    )
    assert "capacity_factor=1.0, pad_to_capacity" in repr(MoE(cfg))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_assign_slots_hold_what_assign_keeps_in_its_order(policy, top_k):
    g = torch.Generator().manual_seed(5)
    for n, capacity in [
        (16, 1),
        (16, 3),
        (16, 40),
        (5, 2),
        (1, 1),
    ]:  # drops, none, more slots than assignments
        logits = torch.randn(n, 4, generator=g)
        logits[:, 0] += 1.5  # (skewed: expert 0 overflows)
        gates, experts = logits.softmax(-1).topk(top_k, dim=-1)
        order, kept = assign(experts, gates, 4, capacity, policy)
        slots, kept_padded = assign_slots(experts, gates, 4, capacity, policy)
        assert slots.shape == (4, capacity) and torch.equal(kept_padded, kept)
        filled = torch.arange(capacity) < kept.unsqueeze(1)  # each expert's first kept[e] slots
        assert torch.equal(slots[filled], order)  # the same assignments in the same order
        assert (slots[~filled] == n * top_k).all()  # the rest: the dummy id
    slots, kept = assign_slots(torch.zeros(0, top_k, dtype=torch.int64), torch.zeros(0, top_k), 4, 0, policy)
    assert slots.shape == (4, 0) and kept.tolist() == [0, 0, 0, 0]


CASES = {  # name -> (MoEConfig overrides, router skew)
    "probs-top2": ({"top_k": 2}, 0.0),
    "position-top2": ({"top_k": 2, "drop_policy": "position"}, 0.0),
    "probs-top1-skewed": ({"top_k": 1, "capacity_factor": 1.25}, 0.6),
    "position-top1-skewed": ({"top_k": 1, "capacity_factor": 1.25, "drop_policy": "position"}, 0.6),
    "probs-top2-skewed-unnormalised": ({"top_k": 2, "capacity_factor": 1.0, "normalize_top_k": False}, 0.6),
}


def check_padded_equals_unpadded(got, want) -> None:
    (y, dx, grads, stats), (y_want, dx_want, grads_want, stats_want) = got, want
    torch.testing.assert_close(y, y_want)
    torch.testing.assert_close(dx, dx_want)
    assert_grads_close(grads, grads_want)
    assert stats[:5] == stats_want[:5]  # kept, routed, capacity, dropped, dropped tokens
    assert stats[5] == pytest.approx(stats_want[5], rel=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_padded_equals_unpadded_at_the_same_capacity_on_one_thread(case):
    overrides, skew = CASES[case]
    unpadded, padded = padded_pair(config(**overrides), seed=1, skew=skew)
    x, w = randn(2, TOKENS // 2, HIDDEN, seed=2) + skew, randn(2, TOKENS // 2, HIDDEN, seed=3)
    want = forward_backward(unpadded, x, w)
    assert want[3][3] > 0  # assignments are dropped
    check_padded_equals_unpadded(forward_backward(padded, x, w), want)


@pytest.mark.parametrize("case", ["probs-top2", "position-top2", "probs-top1-skewed", "position-top1-skewed"])
def test_padded_equals_unpadded_under_expert_parallelism(case):
    overrides, skew = CASES[case]
    cfg = config(num_experts=8, **overrides)
    dense_unpadded, dense_padded = padded_pair(cfg, seed=4, skew=skew)
    xs = [randn(TOKENS, HIDDEN, seed=10 + r) + skew for r in range(2)]  # each rank's own tokens
    ws = [randn(TOKENS, HIDDEN, seed=20 + r) for r in range(2)]

    def body():
        rank = threadpar.get_rank()
        results = []
        for dense in (dense_unpadded, dense_padded):
            moe = MoE(dense.config)  # EP group: the DP group, ep = 2
            assert moe.ep_size == 2
            moe.load_state_dict(dense.state_dict())
            y, dx, _, stats = forward_backward(moe, xs[rank], ws[rank])
            results.append((y, dx, gather_dense_grads(moe), stats))
        return results

    for want, got in run_ranks(body, 2):
        assert want[3][3] > 0
        check_padded_equals_unpadded(got, want)


def test_padded_with_an_aux_loss_group_keeps_the_token_count_on_the_device_and_equals_unpadded():
    cfg = config(top_k=2, aux_loss_coeff=0.1)
    dense_unpadded, dense_padded = padded_pair(cfg, seed=6)
    xs = [randn(TOKENS, HIDDEN, seed=30 + r) for r in range(4)]
    ws = [randn(TOKENS, HIDDEN, seed=40 + r) for r in range(4)]

    def body():
        rank = threadpar.get_rank()
        results = []
        for dense in (dense_unpadded, dense_padded):
            moe = MoE(dense.config, aux_loss_group="CP")  # experts over DP (2), routing counted over CP (2)
            moe.load_state_dict(dense.state_dict())
            y, dx, _, stats = forward_backward(moe, xs[rank], ws[rank])
            results.append((y, dx, gather_dense_grads(moe), stats))
        return results

    for want, got in run_ranks(body, 4, cp=2):
        check_padded_equals_unpadded(got, want)


# graphed steps on the CUDA/NCCL double ---------------------------------------------------------------------------


def make_moe_step(cfg: MoEConfig, ep: int, **moe_kwargs):
    """graphed_and_eager's make(): DDP over the DP group, experts over EP groups of `ep` (carved from DP)."""
    torch.manual_seed(8)
    first, last = torch.nn.Linear(6, HIDDEN), torch.nn.Linear(HIDDEN, 3)
    dense = MoE(cfg, generator=torch.Generator().manual_seed(7)).state_dict()
    g = torch.Generator().manual_seed(9)
    batches = [
        (torch.randn(4, TOKENS // 2, 6, generator=g), torch.randn(4, TOKENS // 2, 3, generator=g))
        for _ in range(6)
    ]

    def make():
        dp, dev = threadpar.get_group("DP"), threadpar.get_device()
        ep_group, _ = expert_parallel_groups(ep)
        moe = MoE(cfg, ep_group, device=dev, **moe_kwargs)
        moe.load_state_dict(dense)
        layers = (copy.deepcopy(first).to(dev), moe, copy.deepcopy(last).to(dev))
        model = DistributedDataParallel(torch.nn.Sequential(*layers))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
        half = 4 // dp.size()

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        def state():
            s = moe.last_stats  # (graphed: the capture's stats, whose tensors every replay rewrites)
            return [
                *model.parameters(),
                s.kept,
                s.routed,
                s.dropped_tensor,
                s.dropped_tokens_tensor,
                s.aux_loss_tensor,
            ]

        def batch(i):
            x, y = batches[i]
            rank = dp.rank()
            return x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]

        return train, state, batch

    return make


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("ep", [1, 2])
def test_a_padded_moe_step_graphs_as_it_runs_eagerly(ep, policy):
    cfg = config(top_k=2, drop_policy=policy, pad_to_capacity=True, aux_loss_coeff=0.1)
    graphed, eager = graphed_and_eager(make_moe_step(cfg, ep), 2)
    assert_graphed_equals_eager(graphed, eager)
    dropped = eager[0][1][-3]
    assert int(dropped) > 0  # (the last step dropped assignments: the capacity binds)


def test_a_padded_moe_with_an_aux_loss_group_graphs_as_it_runs_eagerly():
    cfg = config(top_k=2, pad_to_capacity=True, aux_loss_coeff=0.1)
    graphed, eager = graphed_and_eager(make_moe_step(cfg, 1, aux_loss_group="CP"), 4, cp=2)
    assert_graphed_equals_eager(graphed, eager)


@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity-unpadded"])
@pytest.mark.parametrize("ep", [1, 2])
def test_an_unpadded_moe_is_refused_at_capture_naming_the_fix(ep, capacity_factor):
    cfg = config(capacity_factor=capacity_factor)
    with pytest.raises(GraphCaptureError, match=r"(?s)without pad_to_capacity.*pad_to_capacity=True"):
        graphed_and_eager(make_moe_step(cfg, ep), 2)


def test_a_padded_moe_forward_and_backward_alone_replay_what_eager_calls_compute():
    """No DDP, no optimizer: the layer's own ops in the graph (ep = 2), its input gradients per replay against
    eager calls of the same step on the same weights."""
    cfg = config(top_k=2, pad_to_capacity=True)
    dense = MoE(cfg, generator=torch.Generator().manual_seed(3)).state_dict()
    xs = [randn(TOKENS, HIDDEN, seed=50 + i) for i in range(4)]

    def body():
        dev = threadpar.get_device()
        moe = MoE(cfg, expert_parallel_groups(2)[0], device=dev)
        moe.load_state_dict(dense)

        def step(x):
            x = x.clone().requires_grad_()
            moe(x).square().sum().backward()
            return x.grad

        graphed = threadpar.graphed_step(step, warmup_steps=1)
        on_device = [x.to(dev) for x in xs]
        got = [graphed(x).cpu() for x in on_device]  # eager, captured (and replayed), replayed, replayed
        want = [step(x).cpu() for x in on_device]
        assert moe.last_stats.capacity == expert_capacity(TOKENS, 2, 4, 0.75)
        return graphed.replays, got, want

    for replays, got, want in run_fake_gpus(body, 2, FakeCuda()):
        assert replays == 3
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
