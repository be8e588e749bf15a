"""torch's own parallelism, unchanged, on threadpar's rank threads: DistributedDataParallel, FSDP2, DTensor
tensor/sequence parallelism, 2-D FSDP2 x TP, torch.distributed.pipelining; each against one thread's dense run.

FSDP2 is given the layout's mesh (threadpar.device_mesh(): the ranks' own device type): its default mesh is on
the process's accelerator (torch._C._get_accelerator()), which is CUDA on a GPU machine whatever device the
ranks run on, and the double's GPU in a test process that has used the double."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host
from helpers.torch_dist_models import MLP, Block, batch, full, reference_steps, seeded
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import threadpar
from threadpar import RankFailedError

P = 2
STEPS = 2
INPUTS = [batch(4 * P, seed=s) for s in range(STEPS)]


def mse(out: torch.Tensor) -> torch.Tensor:
    return (out**2).mean()


def threads(body, world_size: int = P, **options):
    return threadpar.launch(body, world_size=world_size, devices="cpu", timeout=30, **options)


def nccl(body, world_size: int = P):
    return to_host(run_fake_gpus(body, world_size, FakeCuda(), timeout=30))


def train(model: nn.Module, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in inputs:
        mse(model(x)).backward()
        opt.step()
        opt.zero_grad()
    return {n: full(p).clone() for n, p in model.named_parameters()}


def local(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return x.chunk(size)[rank]


def assert_params(results, expected, **tolerance):
    for params in results:
        assert params.keys() == expected.keys()
        for name, want in expected.items():
            torch.testing.assert_close(params[name], want, msg=name, **tolerance)


def test_distributed_data_parallel():
    template = seeded(MLP())
    expected = reference_steps(template, INPUTS, mse)

    def body():
        r = dist.get_rank()
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(template))
        params = train(ddp, [local(x, r, P) for x in INPUTS])
        return {n.removeprefix("module."): p for n, p in params.items()}

    assert_params(threads(body), expected)


@pytest.mark.parametrize("run", [threads, nccl], ids=["threads", "nccl"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2(run, reshard):
    template = seeded(nn.Sequential(MLP(), MLP(4, 8, 4)))
    expected = reference_steps(template, INPUTS, mse)

    def body():
        r, device = dist.get_rank(), threadpar.get_device()
        # (built on the rank's device: FSDP2 moves a parameter with `param.data = param.to(device)`, which torch
        # refuses from a host tensor to a device tensor of a wrapper class, the double's)
        model, mesh = copy.deepcopy(template).to(device), threadpar.device_mesh()
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return train(model, [local(x, r, P).to(device) for x in INPUTS])

    assert_params(run(body), expected)


def test_fsdp2_bf16_mixed_precision():
    template = seeded(nn.Sequential(MLP(), MLP(4, 8, 4)))
    expected = reference_steps(template, INPUTS, mse)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def body():
        r = dist.get_rank()
        model, mesh = copy.deepcopy(template), threadpar.device_mesh()
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return train(model, [local(x, r, P) for x in INPUTS])

    results = threads(body)
    # bf16 compute keeps about 3 significant digits; the fp32 master weights are what is compared.
    assert_params(results, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0], results[1])  # every rank holds the same model


def test_fsdp2_rank_failure_ends_the_launch():
    class Fails(nn.Module):
        def forward(self, x):
            if dist.get_rank() == 1:
                raise RuntimeError("rank 1 fails inside FSDP2's forward")
            return x

    def body():
        model, mesh = nn.Sequential(seeded(MLP()), Fails(), seeded(MLP(4, 8, 4))), threadpar.device_mesh()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for _ in range(3):
            mse(model(batch(4))).backward()

    with pytest.raises(RankFailedError, match="rank 1 fails inside FSDP2") as failed:
        threads(body)
    assert failed.value.rank == 1


def test_tensor_and_sequence_parallel():
    template = seeded(nn.Sequential(MLP(), Block(4)))
    x = batch(6)
    seq = batch(3 * 2 * P, 4, seed=7).view(
        3, 2 * P, 4
    )  # (batch, sequence, hidden) for the sequence-parallel block
    ref = copy.deepcopy(template)
    ref_out, ref_seq = ref[0](x), ref[1](seq)
    (mse(ref_out) + mse(ref_seq)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def body():
        mesh = threadpar.device_mesh()
        r = dist.get_rank()
        model = copy.deepcopy(template)
        parallelize_module(model[0], mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
        parallelize_module(
            model[1],
            mesh,
            {
                "norm": SequenceParallel(),
                "mlp.in_proj": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        out = model[0](x)  # replicated input, replicated output
        seq_out = model[1](seq.chunk(P, dim=1)[r])  # this rank's slice of the sequence in and out
        # mse over the whole sequence = the sum over ranks of each slice's squared sum / all elements
        ((seq_out**2).sum() / seq.numel() + mse(out)).backward()
        pieces = [torch.empty_like(seq_out) for _ in range(P)]
        dist.all_gather(pieces, seq_out.detach().contiguous())
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        return out.detach(), torch.cat(pieces, dim=1), grads, type(model[0].in_proj.weight).__name__

    for out, seq_full, grads, kind in threads(body):
        assert kind == "DTensor"
        torch.testing.assert_close(out, ref_out.detach())
        torch.testing.assert_close(seq_full, ref_seq.detach())
        assert grads.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, msg=name)


def test_fsdp2_with_tensor_parallel_on_a_2d_mesh():
    template = seeded(nn.Sequential(MLP(), MLP(4, 8, 4)))
    expected = reference_steps(template, INPUTS, mse)

    def body():
        mesh = threadpar.device_mesh()  # ("dp", "tp") from the layout
        assert mesh.mesh_dim_names == ("dp", "tp")
        model = copy.deepcopy(template)
        for layer in model:
            parallelize_module(
                layer, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
            )
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh.get_local_rank("dp")
        return train(model, [local(x, dp_rank, 2) for x in INPUTS])

    assert_params(threads(body, world_size=4, tp=2), expected)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleInterleavedZeroBubble"])
def test_pipelining(schedule):
    from torch.distributed import pipelining

    per_rank = 1 if schedule == "Schedule1F1B" else 2
    n_stages = P * per_rank
    template = seeded(nn.Sequential(*[_Layer() for _ in range(n_stages)]))
    x, target = batch(8, 4, seed=3), batch(8, 4, seed=4)
    ref = copy.deepcopy(template)
    loss = nn.functional.mse_loss(ref(x), target)
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def body():
        r = dist.get_rank()
        indices = [r + P * k for k in range(per_rank)]  # interleaved: rank r holds stages r, r + P, ...
        layers = copy.deepcopy(template)
        stages = [pipelining.PipelineStage(layers[i], i, n_stages, torch.device("cpu")) for i in indices]
        cls = getattr(pipelining, schedule)
        sched = cls(stages[0] if per_rank == 1 else stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
        losses: list[torch.Tensor] = []
        if r == 0:
            sched.step(x)
        else:
            sched.step(target=target, losses=losses)
        grads = {f"{i}.{n}": p.grad for i in indices for n, p in layers[i].named_parameters()}
        return grads, losses

    results = threads(body)
    grads = {k: v for g, _ in results for k, v in g.items()}
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, msg=name)
    torch.testing.assert_close(torch.stack(results[-1][1]).mean(), loss.detach())


def test_fsdp2_across_processes_on_the_hierarchical_backend():
    """2 simulated processes x 2 rank threads: FSDP2's all-gathers and reduce-scatters span the processes."""
    from threadpar.testing import run_processes

    template = seeded(nn.Sequential(MLP(), MLP(4, 8, 4)))
    expected = reference_steps(template, INPUTS, mse)

    def body():
        model, mesh = copy.deepcopy(template), threadpar.device_mesh()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return train(model, [local(x, dist.get_rank(), 4) for x in INPUTS])

    outcomes = run_processes(body, 2, 2, devices="cpu", timeout=30)
    assert_params([params for process in outcomes for params in process], expected)
