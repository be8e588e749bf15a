"""MoE pieces on their own: capacity, which assignments experts keep, the regrouping of received rows, the
load-balancing loss, initialisation under any ep, configuration errors."""

import pytest
import torch

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    MoE,
    MoEConfig,
    expert_parallel_groups,
    gather_dense_state_dict,
    load_balancing_loss,
)
from threadpar.parallel.expert_parallel.dispatch import expert_major_order, inverse_permutation
from threadpar.parallel.expert_parallel.routing import assign, expert_capacity
from threadpar.testing import run_ranks


def test_capacity_is_megatrons():
    assert expert_capacity(10, 2, 4, 1.0) == 5  # ceil(10 * 2 / 4 * 1.0)
    assert expert_capacity(10, 2, 4, 1.1) == 6
    assert expert_capacity(7, 1, 4, 0.5) == 1
    assert expert_capacity(10, 2, 4, None) is None


def test_assign_keeps_the_highest_gates_or_the_earliest_tokens():
    # 4 tokens, top-1, all to expert 0 except token 2 (expert 1); capacity 2
    experts = torch.tensor([[0], [0], [1], [0]])
    gates = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    order, kept = assign(experts, gates, 2, 2, "probs")
    assert order.tolist() == [1, 3, 2] and kept.tolist() == [2, 1]  # expert 0 keeps tokens 1 and 3
    order, kept = assign(experts, gates, 2, 2, "position")
    assert order.tolist() == [0, 1, 2] and kept.tolist() == [2, 1]  # expert 0 keeps tokens 0 and 1
    order, kept = assign(experts, gates, 2, None, "probs")
    assert order.tolist() == [1, 3, 0, 2] and kept.tolist() == [3, 1]  # dropless: all, by expert


def test_assign_numbers_assignments_token_major_for_top_k():
    experts = torch.tensor([[1, 0], [0, 1]])  # assignment a = token * 2 + slot
    gates = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    order, kept = assign(experts, gates, 2, None, "position")
    assert order.tolist() == [1, 2, 0, 3] and kept.tolist() == [2, 2]


def test_expert_major_order_regroups_rows_by_expert():
    # rows from 2 sources for 2 local experts, arriving (source, expert)-major:
    counts = torch.tensor([[2, 1], [0, 3]])  # source 0: 2 rows for e0, 1 for e1; source 1: 0 and 3
    arrived = ["s0e0", "s0e0", "s0e1", "s1e1", "s1e1", "s1e1"]
    order = expert_major_order(counts)
    assert [arrived[i] for i in order] == ["s0e0", "s0e0", "s0e1", "s1e1", "s1e1", "s1e1"]
    counts = torch.tensor([[1, 1], [1, 1]])
    arrived = ["s0e0", "s0e1", "s1e0", "s1e1"]
    order = expert_major_order(counts)
    assert [arrived[i] for i in order] == ["s0e0", "s1e0", "s0e1", "s1e1"]
    assert inverse_permutation(order)[order].tolist() == list(range(4))


def test_load_balancing_loss_is_the_coefficient_when_balanced_and_grows_with_imbalance():
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([4, 4, 4, 4]), 2, 0.01).item() == pytest.approx(0.01)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert load_balancing_loss(skewed, torch.tensor([8, 8, 0, 0]), 2, 0.01).item() > 0.01


def test_config_and_layer_errors_say_what_to_fix():
    with pytest.raises(ConfigError, match="top_k=5 is more than num_experts=4"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=5)
    with pytest.raises(ConfigError, match="capacity_factor must be a positive number"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, capacity_factor=0)
    with pytest.raises(ConfigError, match="drop_policy must be one of probs, position"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, drop_policy="random")
    with pytest.raises(ConfigError, match="hidden_size must be a positive int"):
        MoEConfig(hidden_size=0, ffn_hidden_size=8, num_experts=4)
    with pytest.raises(TypeError, match="MoE needs a MoEConfig"):
        MoE({"num_experts": 4})

    def body():
        with pytest.raises(ConfigError, match="num_experts=3 is not divisible by the expert-parallel size 2"):
            MoE(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=3, top_k=1))
        with pytest.raises(ConfigError, match="must be a positive int that divides the data-parallel size 2"):
            expert_parallel_groups(3)

    run_ranks(body, 2)


def test_any_ep_initialises_the_same_dense_experts_and_router():
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4)

    def body(ep):
        group = expert_parallel_groups(ep)[0]
        return gather_dense_state_dict(MoE(cfg, group=group))

    by_ep = {ep: run_ranks(body, 4, ep, seed=7) for ep in (1, 2, 4)}
    want = by_ep[1][0]
    assert want["experts.fc1_weight"].shape == (4, 8, 16)
    assert not torch.equal(want["experts.fc1_weight"][0], want["experts.fc1_weight"][1])
    for states in by_ep.values():
        for state in states:
            for name, value in want.items():
                assert torch.equal(state[name], value), name


def test_stats_count_dropped_tokens_and_no_aux_graph_without_grad():
    cfg = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=1, capacity_factor=0.25)
    moe = MoE(cfg, generator=torch.Generator().manual_seed(0))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = moe(x)
    stats = moe.last_stats
    assert stats.capacity == 1 and int(stats.kept.sum()) <= 4
    assert stats.dropped == 16 - int(stats.kept.sum()) and stats.dropped_tokens == stats.dropped  # top-1
    assert stats.dropped_fraction == stats.dropped / 16
    dropped_rows = (y == 0).all(dim=1)
    assert int(dropped_rows.sum()) == stats.dropped_tokens  # a dropped token's output is zero
    assert not y.requires_grad
    assert "experts=4, top_k=1, ep=1, capacity_factor=0.25" in repr(moe)
    assert threadpar.parallel.MoEStats is type(stats)


def test_ranks_with_no_tokens_and_experts_with_none_still_match_one_thread():
    cfg = MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=8, top_k=1)
    dense = MoE(cfg, generator=torch.Generator().manual_seed(2))
    sizes = [0, 1, 3, 2]  # rank 0 has no tokens; most experts get none
    batches = [torch.randn(n, 4, generator=torch.Generator().manual_seed(n)) for n in sizes]

    def body():
        model = MoE(cfg)
        model.load_state_dict(dense.state_dict())
        x = batches[threadpar.get_rank()].clone().requires_grad_()
        y = model(x)
        y.sum().backward()
        return y.detach(), x.grad

    for (y, dx), x in zip(run_ranks(body, 4), batches):
        xr = x.clone().requires_grad_()
        want = dense(xr)
        want.sum().backward()
        torch.testing.assert_close(y, want.detach())
        torch.testing.assert_close(dx, xr.grad)
