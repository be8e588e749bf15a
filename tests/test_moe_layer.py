"""The MoE layer: the batched single-thread layer against a naive per-token reference, then expert
parallelism (ep = 2 and 4, and EP groups carved out of DP) against the single-thread layer run on each
rank's batch: outputs, aux loss, dropped tokens, every gradient, and parameters after optimizer steps."""

import copy

import pytest
import torch
from helpers.moe_reference import naive_moe
from helpers.tp_parity import assert_grads_close, grads_of, randn

import threadpar
from threadpar.parallel import (
    MoE,
    MoEConfig,
    allreduce_moe_grads,
    expert_parallel_groups,
    gather_dense_grads,
    gather_dense_state_dict,
)
from threadpar.testing import run_processes, run_ranks

B, T, HIDDEN, FFN = 2, 6, 8, 16

CASES = {  # name -> MoEConfig overrides
    "dropless-top2": {},
    "capacity-probs": {"capacity_factor": 1.0},
    "capacity-position": {"capacity_factor": 0.5, "drop_policy": "position"},
    "top1-unnormalised": {"top_k": 1, "capacity_factor": 1.25, "normalize_top_k": False},
    # padded to capacity (what a CUDA graph holds: tests/test_moe_graphs.py): the same layer
    "capacity-probs-padded": {"capacity_factor": 1.0, "pad_to_capacity": True},
    "capacity-position-padded": {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True},
}


def config(num_experts=4, **overrides):
    return MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=num_experts, **overrides)


def dense_moe(cfg, seed=0):
    return MoE(cfg, generator=torch.Generator().manual_seed(seed))  # outside a launch: all experts local


@pytest.mark.parametrize("case", CASES)
def test_single_thread_moe_matches_the_naive_reference(case):
    cfg = config(**CASES[case])
    moe = dense_moe(cfg)
    x, w = randn(B, T, HIDDEN, seed=1), randn(B, T, HIDDEN, seed=2)
    xi = x.clone().requires_grad_()
    y = moe(xi)
    (y * w).sum().backward()  # the aux loss's gradient comes along with the output's

    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    xr = x.view(-1, HIDDEN).clone().requires_grad_()
    kwargs = {k: getattr(cfg, k) for k in ("top_k", "capacity_factor", "drop_policy", "normalize_top_k")}
    y_ref, aux_ref, kept_ref = naive_moe(xr, params, num_experts=cfg.num_experts, **kwargs)
    ((y_ref * w.view(-1, HIDDEN)).sum() + aux_ref).backward()

    torch.testing.assert_close(y.view(-1, HIDDEN), y_ref)
    torch.testing.assert_close(torch.tensor(moe.last_stats.aux_loss), aux_ref.detach())
    torch.testing.assert_close(xi.grad.view(-1, HIDDEN), xr.grad)
    assert_grads_close(grads_of(moe), {n: p.grad for n, p in params.items()})
    stats = moe.last_stats
    assert stats.dropped == B * T * cfg.top_k - kept_ref
    assert int(stats.kept.sum()) == kept_ref and int(stats.routed.sum()) == B * T * cfg.top_k
    if cfg.capacity_factor is not None:
        assert int(stats.kept.max()) <= stats.capacity
        assert stats.dropped > 0  # the cases are chosen so that some tokens overflow
    else:
        assert stats.dropped == 0 and stats.capacity is None


def train(model, batches, weights, steps=2, sync=lambda m: None, grads=grads_of):
    """`steps` SGD steps, each over every batch of `batches` with loss sum(y * w) (+ the aux loss).
    Returns, from the first step, per batch (y, x grad, aux loss, dropped) and the gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        outs = []
        for x, w in zip(batches, weights):
            x = x.clone().requires_grad_()
            y = model(x)
            (y * w).sum().backward()
            outs.append((y.detach(), x.grad, model.last_stats.aux_loss, model.last_stats.dropped))
        sync(model)
        if step == 0:
            first = outs, grads(model)
        opt.step()
    return first


def check_ranks_against_reference(results, reference, want_outs, want_grads, batch_of):
    for rank, ((y, dx, aux, dropped), grads, state) in enumerate(results):
        want_y, want_dx, want_aux, want_dropped = want_outs[batch_of(rank)]
        torch.testing.assert_close(y, want_y)
        torch.testing.assert_close(dx, want_dx)
        assert aux == pytest.approx(want_aux, rel=1e-6)
        assert dropped == want_dropped
        assert_grads_close(grads, want_grads)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(
                state[name], value, msg=lambda m, name=name: f"{name} after steps: {m}"
            )


@pytest.mark.parametrize("processes", [1, 2], ids=["threads", "2-processes"])
@pytest.mark.parametrize(
    "case", ["dropless-top2", "capacity-probs", "capacity-position", "capacity-position-padded"]
)
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_moe_matches_the_single_thread_moe(ep, case, processes):
    cfg = config(num_experts=8, **CASES[case])
    dense = dense_moe(cfg, seed=3)
    xs = [randn(B, T, HIDDEN, seed=10 + r) for r in range(ep)]  # each rank's own batch
    ws = [randn(B, T, HIDDEN, seed=20 + r) for r in range(ep)]
    # The reference: one thread, all experts, every rank's batch in turn (capacity is decided per batch,
    # as each rank decides it for its own), gradients accumulated over the batches.
    reference = copy.deepcopy(dense)
    want_outs, want_grads = train(reference, xs, ws)
    if cfg.capacity_factor is not None:
        assert all(out[3] > 0 for out in want_outs)  # every rank drops some assignments

    def body():
        rank = threadpar.get_group("DP").rank()
        model = MoE(cfg)  # EP group: this rank's DP group (ep = dp)
        assert model.ep_size == ep and model.experts.fc1_weight.shape[0] == 8 // ep
        model.load_state_dict(dense.state_dict())  # the dense expert tensors are split on load
        (out,), grads = train(
            model, [xs[rank]], [ws[rank]], sync=allreduce_moe_grads, grads=gather_dense_grads
        )
        return out, grads, gather_dense_state_dict(model)

    if processes == 1:
        results = run_ranks(body, ep)
    else:  # the all-to-alls cross (simulated) processes
        results = [r for process in run_processes(body, processes, ep // processes) for r in process]
    check_ranks_against_reference(results, reference, want_outs, want_grads, batch_of=lambda rank: rank)


def test_ep_groups_carved_out_of_dp_sum_expert_gradients_over_the_expert_dp_group():
    cfg = config(num_experts=4, capacity_factor=1.0)
    dense = dense_moe(cfg, seed=4)
    xs = [randn(B, T, HIDDEN, seed=30 + r) for r in range(4)]
    ws = [randn(B, T, HIDDEN, seed=40 + r) for r in range(4)]
    reference = copy.deepcopy(dense)
    want_outs, want_grads = train(reference, xs, ws)

    def body():
        rank = threadpar.get_rank()
        ep_group, expert_dp = expert_parallel_groups(2)  # dp = 4: EP [0 1] [2 3], expert-DP [0 2] [1 3]
        assert ep_group.ranks == ((0, 1) if rank < 2 else (2, 3))
        assert expert_dp.ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
        model = MoE(cfg, group=ep_group)
        model.load_state_dict(dense.state_dict())

        def sync(m):
            allreduce_moe_grads(m, expert_dp_group=expert_dp)

        (out,), grads = train(model, [xs[rank]], [ws[rank]], sync=sync, grads=gather_dense_grads)
        return out, grads, gather_dense_state_dict(model)

    results = run_ranks(body, 4)
    check_ranks_against_reference(results, reference, want_outs, want_grads, batch_of=lambda rank: rank)
