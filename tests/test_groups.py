"""One answer to "which group?": the layout's combined and expert axes in a launch, the group module's
arithmetic (no collective), and the per-rank parameter records that replace hidden attributes."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    DistributedDataParallel,
    GradPlacement,
    MoE,
    MoEConfig,
    clip_grad_norm_,
    expert_groups,
    grad_placements,
    mark_grad_placements,
)
from threadpar.parallel.groups import data_parallel_group, expert_data_parallel_group
from threadpar.parallel.records import records_of
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.testing import run_ranks

CONFIG = MoEConfig(hidden_size=8, ffn_hidden_size=16, num_experts=4, top_k=1)


def test_get_group_takes_combined_and_expert_axes_named_by_the_layout():
    def body():
        layout, rank = threadpar.get_layout(), threadpar.get_rank()
        found = {}
        for axes in [("DP", "CP"), "DPCP", ("CP", "TP"), "EP", "EDP"]:
            group = threadpar.get_group(axes)
            assert list(group.ranks) == layout.group_ranks(axes, rank), axes
            found[axes if isinstance(axes, str) else "".join(axes)] = group.name
        return found

    results = run_ranks(body, 8, cp=2, tp=2, ep=2)
    # dp = cp = tp = 2: rank 5 is dp 1, cp 0, tp 1, in DP x CP group 1 [1 3 5 7] at place 2: EP run 1 of
    # that group [5 7] (id 1 * 2 + 1), EDP place 0 [1 5] (id 1 * 2 + 0); CP x TP group [4 5 6 7] is dp 1's.
    assert results[5] == {"DPCP": "DPCP1", "CPTP": "CPTP1", "EP": "EP3", "EDP": "EDP2"}


def test_launch_validates_ep_against_dp_times_cp():
    with pytest.raises(ConfigError, match="ep=3 must divide dp\\*cp = 2\\*2 = 4"):
        LaunchConfig(dp=2, cp=2, ep=3)
    with pytest.raises(ConfigError, match="ep must be a positive int"):
        LaunchConfig(ep=0)
    with pytest.raises(ConfigError, match="ep=4 must be a positive int that divides dp\\*cp = 2\\*1 = 2"):
        run_ranks(lambda: None, 4, tp=2, ep=4)


def test_ddp_finds_the_expert_data_parallel_group_without_a_collective():
    """The launch's EDP group for its EP groups, and the CP group for experts over DP under DDP over
    DP x CP: each computed by one rank alone (the others do not call it), so no collective can be
    involved; the old derivation all-gathered over DDP's group and would wait here for the others."""

    def body():
        rank = threadpar.get_rank()
        ep, edp = expert_groups()
        dp_cp = data_parallel_group()
        if rank == 3:  # alone: a collective would time out
            found = expert_data_parallel_group(ep, dp_cp).ranks
            assert list(found) == list(edp.ranks) == [1, 3]
            experts_over_dp = threadpar.get_group("DP")
            assert list(expert_data_parallel_group(experts_over_dp, dp_cp).ranks) == list(
                threadpar.get_group("CP").ranks
            )
        threadpar.barrier()

    run_ranks(body, 4, cp=2, ep=2, timeout=20)


def test_ddp_of_a_moe_over_the_launch_ep_reduces_experts_over_edp_and_records_it():
    def body():
        model = DistributedDataParallel(MoE(CONFIG, "EP"))
        edp = threadpar.get_group("EDP")
        assert list(model.expert_process_group.ranks) == list(edp.ranks)
        experts = {n: r for n, r in model.param_records.items() if "experts" in n}
        dense = {n: r for n, r in model.param_records.items() if "experts" not in n}
        assert experts and dense
        assert all(list(r.group.ranks) == list(edp.ranks) for r in experts.values())
        assert all(list(r.group.ranks) == list(model.process_group.ranks) for r in dense.values())
        # Every parameter's bucket is found in its reducer (the dense ones' and the experts').
        assert all(model.param_records[n].bucket(p) is not None for n, p in model.module.named_parameters())

    run_ranks(body, 4, ep=2)


def test_ddp_records_a_frozen_parameter_with_its_group_and_no_bucket():
    def body():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)
        ddp = DistributedDataParallel(model)
        frozen, trained = ddp.param_records["0.weight"], ddp.param_records["1.weight"]
        assert frozen.group is ddp.process_group and frozen.bucket(model[0].weight) is None
        assert trained.bucket(model[1].weight) is not None

    run_ranks(body, 2)


def test_placements_survive_to_empty_without_marking_again():
    """The record is kept under the module and name, so the new Parameter that to_empty puts there has it."""

    def body():
        model = nn.Sequential(nn.Linear(4, 4, device="meta"))
        mark_grad_placements(model)
        before = grad_placements([model[0].weight])  # the table's index now holds the meta Parameter
        model.to_empty(device="cpu")
        assert grad_placements([model[0].weight]) == before  # the new Parameter: found through the module
        (placement,) = grad_placements([model[0].weight])[:1]
        return [list(g.ranks) for g in placement.replicated_over], list(placement.data_parallel.ranks)

    assert run_ranks(body, 4, dp=2, tp=2)[1] == ([[0, 1]], [1, 3])


def test_records_belong_to_one_launch_and_one_rank():
    """Nothing module-global: a parameter marked in one launch is unmarked in the next, and one rank's
    table does not hold another's records."""
    shared = nn.Parameter(torch.ones(3))
    marked = threading.Event()

    def first():
        if threadpar.get_rank() == 0:
            threadpar.parallel.mark_grad_placement(shared, GradPlacement((threadpar.get_group("TP"),)))
            marked.set()
        threadpar.barrier()
        return records_of([shared])[0] != ()

    assert run_ranks(first, 2, tp=2) == [True, False]
    assert marked.is_set()

    def second():
        shared.grad = torch.ones(3)
        with pytest.raises(ConfigError, match="has no gradient placement"):
            clip_grad_norm_([shared], 1.0)

    run_ranks(second, 2, tp=2)
