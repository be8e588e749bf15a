"""Issue 29: ranks sharing a GPU, on the CUDA double's shared mode (fakes/fake_shared_gpu.py): 4 rank threads on
one fake GPU (or two), the threads backend, every rank computing on a default stream of its own. The parity
suites run there as on CPU threads and match their single-thread references (torch.testing.assert_close in
each suite), and every rank's work after a collective is ordered after every peer's work before it.

The suites are reused whole: their module's runner (`run_ranks`, or the torch.distributed tests' `threads`) is
replaced by the shared mode's for one call; the DDP and ZeRO helpers take a `runner` of their own."""

from __future__ import annotations

import functools

import pytest
import test_collectives as collectives_suite
import test_pipeline_executor as pipeline_suite
import test_torch_dist_training as torch_dist_suite
import test_tp_layers as tp_suite
import torch
from fakes.fake_cuda_nccl import FakeCuda
from fakes.fake_device_index import fake_device_index
from fakes.fake_shared_gpu import run_shared_fake_gpu, shared_runner
from fakes.sim_gpu import to_host
from helpers.ddp_reference import adam, assert_same, batches, ddp_run, mlp, reference_run
from helpers.zero_reference import assert_same_state, plain, reference, zero, zero_run

import threadpar
import threadpar.comm.threads.group as threads_backend


@pytest.fixture(params=[1, 2], ids=["1gpu", "2gpus"])
def gpus(request) -> int:
    """How many fake GPUs the ranks share: 1 (every rank on fake GPU 0) or 2 (round-robin)."""
    return request.param


@pytest.fixture
def on_shared_gpus(monkeypatch, gpus):
    """Point a suite module's runner at the shared mode."""

    def run(body, world_size=None, **layout):
        world_size = world_size if world_size is not None else torch_dist_suite.P
        layout.pop("devices", None), layout.pop("timeout", None)
        return to_host(run_shared_fake_gpu(body, world_size, gpus=gpus, **layout))  # (compared on the host)

    def point(module, name="run_ranks"):
        monkeypatch.setattr(module, name, run)
        return run

    return point


def test_ranks_on_one_fake_gpu_share_its_index_and_stream_pools_but_not_their_streams(gpus):
    fake = FakeCuda()

    def body():
        device = threadpar.get_device()
        return fake_device_index(), fake.pool_stream(device, 0), fake.current_stream(device)

    results = run_shared_fake_gpu(body, 4, fake, gpus=gpus)
    assert [index for index, _, _ in results] == [r % gpus for r in range(4)]
    pools = [pool for _, pool, _ in results]
    assert all(p.device_index == r % gpus for r, p in enumerate(pools))
    assert len(set(map(id, pools))) == 4  # one pool per GPU, handed out round-robin (c10/cuda/CUDAStream.cpp)
    assert len({id(default) for _, _, default in results}) == 4  # each rank on a stream of its own


@pytest.mark.parametrize("path", ["one_thread", "split"])
def test_collectives_order_every_peers_earlier_work_before_each_ranks_later_work(path, gpus, monkeypatch):
    monkeypatch.setattr(threads_backend, "SMALL_BYTES", 1 << 40 if path == "one_thread" else -1)
    fake, P = FakeCuda(), 4

    def body():
        device = threadpar.get_device()
        stream = fake.current_stream(device)
        rank, marks = threadpar.get_rank(), []
        t = torch.full((6,), float(rank), device=device)
        for op in ("all_reduce", "all_gather", "broadcast", "reduce_scatter"):
            before = fake.mark(stream, f"{op} input")
            if op == "all_reduce":
                threadpar.all_reduce(t)
            elif op == "all_gather":
                threadpar.all_gather([torch.empty(6, device=device) for _ in range(P)], t)
            elif op == "broadcast":
                threadpar.broadcast(t, src=3)
            else:
                threadpar.reduce_scatter_tensor(
                    torch.empty(2, device=device), torch.arange(8.0, device=device)
                )
            marks.append((before, fake.mark(stream, f"after {op}")))
        return marks, t

    results = run_shared_fake_gpu(body, P, fake, gpus=gpus)
    for _, t in results:
        torch.testing.assert_close(to_host(t), torch.full((6,), float(sum(range(P)))))
    for step in range(4):
        for rank in range(P):
            for peer in range(P):
                assert fake.ordered(results[peer][0][step][0], results[rank][0][step][1]), (step, rank, peer)


def test_collectives_suite(on_shared_gpus, monkeypatch):
    on_shared_gpus(collectives_suite)
    for path in ("one_thread", "split"):
        monkeypatch.setattr(threads_backend, "SMALL_BYTES", 1 << 40 if path == "one_thread" else -1)
        collectives_suite.test_all_gather_and_reduce_scatter(4, path)
        collectives_suite.test_broadcast_reduce_scatter_gather(4, path)


@pytest.mark.parametrize(
    "bucketing", [{"bucket_cap_mb": 25}, {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}]
)
@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_ddp_matches_one_thread(gpus, bucketing, view):
    template, world = mlp(), 4
    data = batches(steps=3, rows=4 * world, n_in=6, n_out=3)
    expected_grads, expected_params = reference_run(template, data, adam)
    runs = ddp_run(
        template, data, adam, world, runner=shared_runner(gpus), gradient_as_bucket_view=view, **bucketing
    )
    for rank, (grads, params) in enumerate(runs):
        assert_same(grads, expected_grads, f"rank {rank} gradient")
        assert_same(params, expected_params, f"rank {rank} parameter")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD], ids=lambda c: c.__name__)
def test_zero_matches_one_thread(gpus, stage, cls):
    template = mlp()
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    expected, expected_state, _ = reference(template, data, plain(cls))
    for params, state, _ in zero_run(template, data, zero(cls, stage), 4, runner=shared_runner(gpus)):
        assert_same(params, expected, f"parameters (stage {stage})")
        assert_same_state(state, expected_state, f"state_dict (stage {stage})")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tensor_parallel_suite(on_shared_gpus, sp):
    on_shared_gpus(tp_suite)
    tp_suite.test_mlp_block_matches_dense_in_outputs_gradients_and_after_optimizer_steps(4, sp)


@pytest.mark.parametrize("schedule,pp,v,n", [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4)], ids=str)
def test_pipeline_suite(on_shared_gpus, schedule, pp, v, n):
    on_shared_gpus(pipeline_suite)
    pipeline_suite.test_train_step_matches_the_whole_model_in_one_thread(schedule, pp, v, n)


def test_torch_ddp_and_fsdp2_through_the_torch_distributed_bridge(on_shared_gpus):
    run = on_shared_gpus(torch_dist_suite, "threads")
    torch_dist_suite.test_distributed_data_parallel()
    torch_dist_suite.test_fsdp2(functools.partial(run, world_size=torch_dist_suite.P), reshard=True)
