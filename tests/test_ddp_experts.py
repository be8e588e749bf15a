"""DistributedDataParallel with MoE experts sharded over EP groups: the experts are not averaged as replicas
but reduced over the ranks holding the same experts, and the result is the single-thread MoE's gradient."""

import pytest
import torch
from helpers.tp_parity import assert_grads_close, grads_of, randn, seed_params_

import threadpar
from threadpar.parallel import (
    DistributedDataParallel,
    MoE,
    MoEConfig,
    expert_parallel_groups,
    gather_dense_grads,
    gather_dense_state_dict,
)
from threadpar.parallel.ddp import comm_hooks
from threadpar.testing import run_ranks

CONFIG = MoEConfig(
    hidden_size=8, ffn_hidden_size=16, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coeff=0.1
)
DP, TOKENS = 4, 6


def objective(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    return moe(x).square().mean()


@pytest.mark.parametrize("hook", [None, comm_hooks.allreduce_hook])
def test_ddp_reduces_sharded_experts_over_the_ranks_that_hold_them(hook):
    dense = seed_params_(MoE(CONFIG), seed=1)
    x = randn(DP, TOKENS, CONFIG.hidden_size, seed=2)
    # One thread: each rank's batch is one forward (routing and capacity per forward), the mean of the
    # ranks' losses (aux losses included) is the objective.
    reference = seed_params_(MoE(CONFIG), seed=1)
    reference.aux_loss_scale = 1 / DP
    for r in range(DP):
        (objective(reference, x[r]) / DP).backward()
    want = grads_of(reference)

    def body():
        ep_group, expert_dp_group = expert_parallel_groups(2)  # EP [d0 d1] [d2 d3]
        moe = MoE(CONFIG, ep_group)
        moe.load_state_dict(dense.state_dict())  # each rank keeps its 2 of the 4 experts
        ddp = DistributedDataParallel(moe)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        state = gather_dense_state_dict(moe)  # wrapping broadcast nothing across different experts
        objective(ddp, x[threadpar.get_rank()]).backward()
        return ddp.expert_process_group.ranks, expert_dp_group.ranks, state, gather_dense_grads(moe)

    for rank, (derived, expected, state, grads) in enumerate(run_ranks(body, DP)):
        assert list(derived) == list(expected) == [rank % 2, rank % 2 + 2]
        for name, value in dense.state_dict().items():
            torch.testing.assert_close(state[name], value)
        assert_grads_close(grads, want)


def test_ddp_refuses_experts_sharded_outside_its_group_and_a_hook_state_for_one_group():
    def body():
        moe = MoE(CONFIG, "CP")  # experts over the CP group, DDP over the DP group: not carved out of it
        with pytest.raises(threadpar.ConfigError, match="are not in DDP's group"):
            DistributedDataParallel(moe, process_group="DP")
        ddp = DistributedDataParallel(MoE(CONFIG))  # experts over the DP group (the MoE default)
        # DDP's group is DP x CP; the ranks holding this rank's experts are its CP group.
        assert ddp.expert_process_group.ranks == threadpar.get_group("CP").ranks
        with pytest.raises(threadpar.ConfigError, match="register with state=None"):
            ddp.register_comm_hook(ddp.process_group, comm_hooks.allreduce_hook)

    run_ranks(body, 4, cp=2)


def test_wrapping_copies_experts_from_the_first_rank_holding_them_and_the_rest_from_the_first_rank():
    def body():
        rank = threadpar.get_rank()
        moe = seed_params_(
            MoE(CONFIG, expert_parallel_groups(2)[0]), seed=10 + rank
        )  # different on every rank
        ddp = DistributedDataParallel(moe)
        return {n: p.detach().clone() for n, p in moe.named_parameters()}, ddp.expert_process_group.ranks[0]

    results = run_ranks(body, DP)
    for params, source in results:
        for name, value in params.items():
            src = source if name.startswith("experts.") else 0
            torch.testing.assert_close(value, results[src][0][name], msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(results[0][0]["experts.fc1_weight"], results[1][0]["experts.fc1_weight"])
