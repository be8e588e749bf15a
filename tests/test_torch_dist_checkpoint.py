"""torch's distributed checkpoint (DCP) of an FSDP2 model and its optimizer, saved and loaded on rank threads.

Each rank writes its own shards and DCP's planner meets the others through torch.distributed's collectives
(on the `threadpar` backend); a model built with other weights loads them back and then trains on as the
saved one does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.torch_dist_models import batch, seeded
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import threadpar

P = 2


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = seeded(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), seed=seed)
    # The layout's mesh on the ranks' devices: FSDP2's default mesh is on torch's accelerator
    # (_fsdp_init._init_default_fully_shard_mesh, torch._C._get_accelerator), a GPU once one is in the process,
    # wherever the ranks run; here the CUDA double may be (tests/fakes/sim_gpu.py), and the ranks run on the host.
    mesh = threadpar.device_mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = batch(4 * P, seed=seed).chunk(P)[dist.get_rank()]
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.state_dict().items()}


def test_an_fsdp2_checkpoint_saved_by_the_ranks_loads_into_other_weights_and_training_resumes(tmp_path: Path):
    def body(path: str) -> tuple[dict, dict, dict, dict]:
        model, opt = sharded(seed=0)
        step(model, opt, seed=1)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        saved = full(model)

        other, other_opt = sharded(seed=7)
        model_state, optim_state = get_state_dict(other, other_opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = full(other)

        step(model, opt, seed=2)  # Adam's moments came back too: the next step is the same
        step(other, other_opt, seed=2)
        return saved, loaded, full(model), full(other)

    results = threadpar.launch(body, str(tmp_path), world_size=P, devices="cpu", timeout=60)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file of shards per rank
    for saved, loaded, resumed, resumed_loaded in results:
        assert saved.keys() == loaded.keys() and saved["0.weight"].shape == (16, 8)
        for name in saved:
            torch.testing.assert_close(loaded[name], saved[name])
            torch.testing.assert_close(resumed_loaded[name], resumed[name])
    built_with = _weights(seed=7)
    assert all(not torch.equal(results[0][1][name], value) for name, value in built_with.items())


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """The weights the loading model was built with (so the load must have changed them)."""
    model = seeded(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), seed=seed)
    return {name: p.detach() for name, p in model.state_dict().items()}
