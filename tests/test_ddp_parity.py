"""DistributedDataParallel against one thread on the whole batch: gradients after one step, parameters after
several (SGD with momentum and Adam), for every way of bucketing, accumulating and sharding."""

import contextlib
import copy

import pytest
import torch
from helpers.ddp_reference import (
    DTYPE,
    adam,
    assert_same,
    batches,
    ddp_run,
    grads_of,
    mlp,
    mse,
    params_of,
    rank_slice,
    reference_run,
    sgd,
)
from torch import nn

import threadpar
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.ddp import comm_hooks
from threadpar.testing import run_ranks

TINY_MB = 1e-4  # 104 bytes: about one parameter per bucket
BUCKETING = {
    "one_bucket": {"bucket_cap_mb": 25, "first_bucket_cap_mb": 25},
    "many_buckets": {"bucket_cap_mb": TINY_MB, "first_bucket_cap_mb": TINY_MB},
    "no_bucketing": {"gradient_bucketing": False},
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bucketing", list(BUCKETING))
@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("optimizer", [sgd, adam], ids=["sgd", "adam"])
def test_matches_single_thread_on_the_whole_batch(world, bucketing, view, optimizer):
    template = mlp()
    data = batches(steps=3, rows=4 * world, n_in=6, n_out=3)
    expected_grads, expected_params = reference_run(template, data, optimizer)
    for rank, (grads, params) in enumerate(
        ddp_run(template, data, optimizer, world, gradient_as_bucket_view=view, **BUCKETING[bucketing])
    ):
        assert_same(grads, expected_grads, f"rank {rank} gradient")
        assert_same(params, expected_params, f"rank {rank} parameter")


def test_float32_with_default_tolerances():
    template = mlp().float()
    data = [tuple(t.float() for t in pair) for pair in batches(steps=3, rows=8, n_in=6, n_out=3)]
    expected_grads, expected_params = reference_run(template, data, sgd)
    for grads, params in ddp_run(template, data, sgd, 2):
        assert_same(grads, expected_grads, "gradient")
        assert_same(params, expected_params, "parameter")


def test_replicas_start_equal_to_the_first_rank_and_frozen_parameters_are_left_alone():
    template = mlp()
    template[0].bias.requires_grad_(False)
    data = batches(steps=2, rows=6, n_in=6, n_out=3)
    _, expected_params = reference_run(template, data, sgd)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        if rank > 0:  # a different start on the other ranks: DDP must replace it by rank 0's
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(rank)
        ddp = DistributedDataParallel(model)
        assert model[0].bias.grad is None
        optimizer = sgd([p for p in model.parameters() if p.requires_grad])
        for x, y in data:
            optimizer.zero_grad()
            mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
            optimizer.step()
        assert model[0].bias.grad is None
        return params_of(model)

    for params in run_ranks(body, 2):
        assert_same(params, expected_params, "parameter")


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_no_sync_accumulates_locally_and_the_last_micro_batch_averages_the_sum(view):
    """The usual loop: forward and backward per micro-batch, all but the last inside no_sync()."""
    template, micro = mlp(), 3
    data = batches(steps=2 * micro, rows=4, n_in=6, n_out=3)
    model = copy.deepcopy(template)
    optimizer = sgd(list(model.parameters()))
    for step in range(2):
        optimizer.zero_grad()
        for x, y in data[step * micro : (step + 1) * micro]:
            (mse(model, x, y) / micro).backward()
        optimizer.step()
    expected = params_of(model)
    launches = []

    def counting_hook(group, bucket):
        launches.append(bucket.index())
        return comm_hooks.allreduce_hook(group, bucket)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=view, bucket_cap_mb=TINY_MB)
        if rank == 0:
            ddp.register_comm_hook(None, counting_hook)
        optimizer = sgd(list(model.parameters()))
        for step in range(2):
            optimizer.zero_grad(set_to_none=False)
            for k, (x, y) in enumerate(data[step * micro : (step + 1) * micro]):
                loss = mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)) / micro
                if k < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            optimizer.step()
        return params_of(model), len(ddp.reducer.bucket_indices())

    results = run_ranks(body, 2)
    for params, _ in results:
        assert_same(params, expected, "parameter")
    n_buckets = results[0][1]
    assert launches == list(range(n_buckets)) * 2  # communication once per step, every bucket in order


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_pipeline_pattern_k_forwards_then_k_backwards_all_but_last_under_no_sync(view):
    """What the pipeline executor does: forwards of every micro-batch first, then their backwards; no_sync
    applies to the backwards it wraps, not to the forwards."""
    template, micro = mlp(), 4
    data = batches(steps=micro, rows=6, n_in=6, n_out=3)
    reference = copy.deepcopy(template)
    for x, y in data:
        (mse(reference, x, y) / micro).backward()
    expected = grads_of(reference)

    launches = []

    def counting_hook(group, bucket):
        launches.append(bucket.index())
        return comm_hooks.allreduce_hook(group, bucket)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=view, bucket_cap_mb=TINY_MB)
        if rank == 0:
            ddp.register_comm_hook(None, counting_hook)
        losses = []
        for k, (x, y) in enumerate(data):
            # Where a forward runs does not matter: the last micro-batch's forward is inside no_sync.
            with ddp.no_sync() if k in (0, micro - 1) else contextlib.nullcontext():
                losses.append(mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)) / micro)
        for loss in losses[:-1]:
            with ddp.no_sync():
                loss.backward()
        losses[-1].backward()
        return grads_of(model), len(ddp.reducer.bucket_indices())

    results = run_ranks(body, 2)
    for grads, _ in results:
        assert_same(grads, expected, "gradient")
    assert launches == list(range(results[0][1]))  # one synchronizing backward: the last one


class Branches(nn.Module):
    """A trunk, two heads used on different ranks, and a parameter no rank uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 3)])
        self.never = nn.Linear(5, 3)

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.trunk(x)))


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_unused_parameters_with_find_unused_parameters(view):
    torch.manual_seed(0)
    template = Branches().to(DTYPE)
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    world = 2

    def step_loss(model, x, y, rank):
        # Rank r uses head r; micro-batch-free. The reference sums the per-rank losses / world.
        return nn.functional.mse_loss(model(rank_slice(x, rank, world), rank), rank_slice(y, rank, world))

    reference = copy.deepcopy(template)
    optimizer = adam(list(reference.parameters()))
    for x, y in data:
        optimizer.zero_grad()
        (sum(step_loss(reference, x, y, r) for r in range(world)) / world).backward()
        optimizer.step()
    expected = params_of(reference)
    assert reference.never.weight.grad is None

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, find_unused_parameters=True, gradient_as_bucket_view=view)
        optimizer = adam(list(model.parameters()))
        for x, y in data:
            optimizer.zero_grad()
            step_loss(ddp, x, y, rank).backward()
            # Used on one rank only: averaged everywhere. Used nowhere: None, as in the reference.
            assert model.heads[1 - rank].weight.grad is not None
            assert model.never.weight.grad is None
            optimizer.step()
        return params_of(model)

    for params in run_ranks(body, world):
        assert_same(params, expected, "parameter")


def test_gradient_accumulated_under_no_sync_is_synced_even_if_unused_in_the_last_backward():
    torch.manual_seed(0)
    template = Branches().to(DTYPE)
    (x0, y0), (x1, y1) = batches(steps=2, rows=4, n_in=6, n_out=3)
    reference = copy.deepcopy(template)
    for r in range(2):  # micro-batch 1 uses head 0 on every rank; micro-batch 2 uses head 1
        (nn.functional.mse_loss(reference(rank_slice(x0, r, 2), 0), rank_slice(y0, r, 2)) / 2).backward()
        (nn.functional.mse_loss(reference(rank_slice(x1, r, 2), 1), rank_slice(y1, r, 2)) / 2).backward()
    expected = grads_of(reference)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(rank_slice(x0, rank, 2), 0), rank_slice(y0, rank, 2)).backward()
        nn.functional.mse_loss(ddp(rank_slice(x1, rank, 2), 1), rank_slice(y1, rank, 2)).backward()
        return grads_of(model)

    for grads in run_ranks(body, 2):
        assert_same(grads, expected, "gradient")


def test_batchnorm_buffers_follow_the_first_rank():
    """BatchNorm in training mode normalizes each rank's own batch, so the reference runs every rank's chunk
    separately; running stats come from rank 0 (broadcast at every forward), as in torch's DDP."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    world = 2

    reference = copy.deepcopy(template)
    optimizer = sgd(list(reference.parameters()))
    for x, y in data:
        optimizer.zero_grad()
        losses = []
        for r in range(world):
            saved = {k: b.clone() for k, b in reference.named_buffers()}
            losses.append(mse(reference, rank_slice(x, r, world), rank_slice(y, r, world)))
            if r > 0:  # only rank 0's update of the running stats survives
                for k, b in reference.named_buffers():
                    b.data.copy_(saved[k])  # .data: BatchNorm saved these for backward
        (sum(losses) / world).backward()
        optimizer.step()
    expected_params = params_of(reference)
    expected_buffers = {k: b.clone() for k, b in reference.named_buffers()}

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        optimizer = sgd(list(model.parameters()))
        for x, y in data:
            optimizer.zero_grad()
            mse(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            optimizer.step()
        ddp.eval()
        with torch.no_grad():
            ddp(data[0][0][:2])  # eval forward: buffers broadcast from rank 0, not updated
        return params_of(model), {k: b.clone() for k, b in model.named_buffers()}

    for params, buffers in run_ranks(body, world):
        assert_same(params, expected_params, "parameter")
        assert_same(buffers, expected_buffers, "buffer")


def test_batchnorm_with_several_forwards_before_their_backwards():
    """The pipeline pattern through BatchNorm: the buffer broadcast of a later forward must not invalidate
    what an earlier forward saved for its backward."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    reference = copy.deepcopy(template)
    chunks = [(rank_slice(x, r, 2), rank_slice(y, r, 2)) for x, y in data for r in range(2)]
    (sum(mse(reference, x, y) for x, y in chunks) / len(chunks)).backward()  # each chunk normalized alone
    expected = grads_of(reference)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        losses = [mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)) / len(data) for x, y in data]
        with ddp.no_sync():
            for loss in losses[:-1]:
                loss.backward()
        losses[-1].backward()
        return grads_of(model)

    for grads in run_ranks(body, 2):
        assert_same(grads, expected, "gradient")


class ColumnShard(nn.Module):
    """Rank t of the TP group holds rows t*h .. (t+1)*h of a (2h x n) weight and scores only its outputs:
    the full loss is the sum over shards, so a shard's gradient needs no TP communication."""

    def __init__(self, weight_shard):
        super().__init__()
        self.weight = nn.Parameter(weight_shard.clone())

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


def test_tensor_parallel_shards_are_averaged_over_the_dp_group_only():
    dp, tp, n, h, steps = 2, 2, 5, 3, 2
    g = torch.Generator().manual_seed(3)
    full = torch.randn(tp * h, n, generator=g, dtype=DTYPE)
    data = [torch.randn(dp * 4, n, generator=g, dtype=DTYPE) for _ in range(steps)]

    def loss_of(out):
        return (out**2).sum(dim=1).mean()

    weight = nn.Parameter(full.clone())
    optimizer = sgd([weight])
    for x in data:
        optimizer.zero_grad()
        loss_of(torch.tanh(x @ weight.t())).backward()
        optimizer.step()
    expected = weight.detach()

    def body():
        c = threadpar.get_coords()
        shard = full[c.tp * h : (c.tp + 1) * h] + c.dp  # DP ranks start differently: rank dp=0 wins
        model = ColumnShard(shard)
        ddp = DistributedDataParallel(model)
        assert ddp.process_group.ranks == tuple(
            threadpar.get_layout().group_ranks("DP", threadpar.get_rank())
        )
        optimizer = sgd([model.weight])
        for x in data:
            optimizer.zero_grad()
            loss_of(ddp(rank_slice(x, c.dp, dp))).backward()
            optimizer.step()
        return c.tp, model.weight.detach()

    for t, shard in run_ranks(body, dp * tp, tp=tp):
        torch.testing.assert_close(shard, expected[t * h : (t + 1) * h])


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize(
    ("hook", "dtype"),
    [(comm_hooks.bf16_compress_hook, torch.bfloat16), (comm_hooks.fp16_compress_hook, torch.float16)],
)
def test_compression_hooks_average_in_low_precision(hook, dtype, view):
    """The result is exactly the low-precision average of the ranks' local gradients (and so within that
    precision of the reference, not equal to it)."""
    template = mlp().float()
    x, y = (t.float() for t in batches(steps=1, rows=8, n_in=6, n_out=3)[0])

    def body():
        rank = threadpar.get_rank()
        local = copy.deepcopy(template)
        mse(local, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, bucket_cap_mb=TINY_MB, gradient_as_bucket_view=view)
        ddp.register_comm_hook(None, hook)
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        return grads_of(local), grads_of(model)

    (local0, synced0), (local1, synced1) = run_ranks(body, 2)
    reference = copy.deepcopy(template)
    mse(reference, x, y).backward()
    for name, p in reference.named_parameters():
        exact = (local0[name].to(dtype) / 2 + local1[name].to(dtype) / 2).float()
        torch.testing.assert_close(synced0[name], exact, rtol=0, atol=0)
        torch.testing.assert_close(synced1[name], exact, rtol=0, atol=0)
        torch.testing.assert_close(synced0[name], p.grad, rtol=2e-2, atol=1e-3)
