"""ZeroRedundancyOptimizer refuses bad input with a ConfigError that says what to do, before it changes
anything (parameters keep their storage, loaded state leaves the optimizer as it was)."""

import copy

import pytest
import torch
from helpers.ddp_reference import batches, mlp, mse, rank_slice
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import DistributedDataParallel, ZeroRedundancyOptimizer
from threadpar.parallel.ddp import comm_hooks
from threadpar.testing import on_ranks, run_ranks


@pytest.mark.parametrize("stage", [0, 3, True, "1"])
def test_a_stage_other_than_1_or_2(stage):
    with pytest.raises(ConfigError, match=r"stage=.*use stage=1 .* or stage=2"):
        ZeroRedundancyOptimizer([nn.Parameter(torch.zeros(2))], stage=stage)


def _storage(params):
    return [p.data_ptr() for p in params]


@on_ranks(2)
def test_parameters_in_no_group_it_can_shard_over():
    model = mlp()
    before = _storage(model.parameters())
    with pytest.raises(
        ConfigError, match=r"belongs to no group the optimizer can shard over.*DistributedDataParallel"
    ):
        ZeroRedundancyOptimizer(model.parameters(), lr=0.1)
    assert _storage(model.parameters()) == before


@on_ranks(4, tp=2)
def test_parameters_reduced_over_another_dp_group_than_the_one_given():
    model = mlp()
    DistributedDataParallel(model)  # over this rank's DP group
    before = _storage(model.parameters())
    with pytest.raises(ConfigError, match=r"two different DP groups.*process_group=None"):
        ZeroRedundancyOptimizer(model.parameters(), process_group="TP", lr=0.1)
    assert _storage(model.parameters()) == before


@on_ranks(4, tp=2)
def test_one_parameter_reduced_over_two_groups():
    model = mlp()
    DistributedDataParallel(model)
    DistributedDataParallel(model, process_group="TP")
    with pytest.raises(ConfigError, match=r"two different groups"):
        ZeroRedundancyOptimizer(model.parameters(), lr=0.1)


@on_ranks(2)
def test_stage_2_needs_every_parameter_of_the_ddp_module_and_ddp_itself():
    model = mlp()
    ddp = DistributedDataParallel(model)  # kept: the optimizer refers to its reducer weakly
    with pytest.raises(ConfigError, match=r"not in this optimizer.*or use stage=1"):
        ZeroRedundancyOptimizer(list(model.parameters())[:2], stage=2, lr=0.1)
    ZeroRedundancyOptimizer(list(model.parameters())[:2], stage=1, lr=0.1)  # fine for ZeRO-1
    del ddp
    alone = mlp()
    with pytest.raises(ConfigError, match=r"no DistributedDataParallel reduces parameter"):
        ZeroRedundancyOptimizer(alone.parameters(), stage=2, process_group="DP", lr=0.1)


@on_ranks(2)
def test_stage_2_and_a_comm_hook_exclude_each_other():
    model = mlp()
    ddp = DistributedDataParallel(model)
    ZeroRedundancyOptimizer(model.parameters(), stage=2, lr=0.1)
    with pytest.raises(ConfigError, match=r"ZeRO-2 optimizer already reduce-scatters"):
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)


@on_ranks(2)
def test_an_optimizer_whose_state_is_not_element_wise():
    model = mlp()
    DistributedDataParallel(model)
    before = _storage(model.parameters())
    with pytest.raises(ConfigError, match=r"'row_var'.*element by element"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adafactor, lr=0.01)
    with pytest.raises(ConfigError, match=r"cannot step a plain tensor"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)
    assert _storage(model.parameters()) == before


def _trained(cls, world, **hyper):
    """State dicts after one step of a ZeRO optimizer of class `cls` on `world` ranks."""
    template = mlp()
    x, y = batches(steps=1, rows=8, n_in=6, n_out=3)[0]

    def body():
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), cls, **hyper)
        r = threadpar.get_rank()
        mse(ddp, rank_slice(x, r, world), rank_slice(y, r, world)).backward()
        zero.step()
        return zero.state_dict()

    return template, run_ranks(body, world)[0]


def test_loading_state_of_another_optimizer_class():
    template, sgd_state = _trained(torch.optim.SGD, 2, lr=0.1, momentum=0.9)
    plain_sgd = torch.optim.SGD(copy.deepcopy(template).parameters(), lr=0.1, momentum=0.9)
    plain_sgd.load_state_dict({k: v for k, v in sgd_state.items() if k != "zero"})
    _, adamw_state = _trained(torch.optim.AdamW, 2, lr=0.01)

    def body():
        model = copy.deepcopy(template)
        DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
        zero.load_state_dict(adamw_state)
        before = {k: v.clone() for s in zero.optim.state.values() for k, v in s.items()}
        with pytest.raises(ConfigError, match=r"saved by a torch\.optim\.sgd\.SGD optimizer, this one runs"):
            zero.load_state_dict(sgd_state)
        with pytest.raises(ConfigError, match=r"has keys \['momentum_buffer'\], but AdamW keeps"):
            zero.load_state_dict(plain_sgd.state_dict())  # a plain optimizer's: no class recorded
        after = {k: v for s in zero.optim.state.values() for k, v in s.items()}
        for key, value in before.items():
            torch.testing.assert_close(after[key], value)

    run_ranks(body, 2)
