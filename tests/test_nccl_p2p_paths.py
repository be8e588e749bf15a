"""The point-to-point users besides pipelines on the nccl double, in one simulated process and across two:
ring attention (the CP group's permute), MoE's all-to-all with uneven splits, torch.distributed's
batch_isend_irecv, and ProcessGroup.exchange's refusals (issue 39)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fakes.fake_cuda_nccl import FakeCuda, fake_gpu_processes, run_fake_gpu_processes, run_fake_gpus
from fakes.sim_gpu import to_host

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import restore_sequence_order, ring_attention, split_sequence

pytestmark = pytest.mark.usefixtures("fake_mode")

B, H, T, D = 2, 2, 16, 8


def on_the_double(body, world: int, processes: int, **layout):
    """`body`'s results per global rank: `world` ranks in one simulated process or in `processes`."""
    if processes == 1:
        return run_fake_gpus(body, world, FakeCuda(), **layout)
    per_process = run_fake_gpu_processes(body, fake_gpu_processes(processes), world // processes, **layout)
    return [r for process in per_process for r in process]


@pytest.mark.parametrize("processes", [1, 2])
def test_ring_attention_matches_full_attention(processes):
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    (want_out * w).sum().backward()

    def body():
        dev = threadpar.get_device()
        parts = [split_sequence(t.to(dev), dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*parts, causal=True)
        (out * split_sequence(w.to(dev), dim=2)).sum().backward()
        return to_host([out.detach(), *(p.grad for p in parts)])

    per_rank = on_the_double(body, 4, processes, cp=4)
    got = [restore_sequence_order(torch.cat(parts, dim=2), 4, dim=2) for parts in zip(*per_rank)]
    for g_, e in zip(got, [want_out.detach(), *(t.grad for t in ref)]):
        torch.testing.assert_close(g_, e)


@pytest.mark.parametrize("processes", [1, 2])
def test_moe_style_all_to_all_with_uneven_splits(processes):
    world = 4

    def rows(src: int, dst: int) -> torch.Tensor:  # what src sends dst: (src + dst) % 3 + 1 rows
        n = (src + dst) % 3 + 1
        return torch.full((n, 2), float(10 * src + dst))

    def body():
        r, dev = threadpar.get_rank(), threadpar.get_device()
        send = torch.cat([rows(r, d) for d in range(world)]).to(dev)
        out = torch.empty(sum(rows(s, r).shape[0] for s in range(world)), 2, device=dev)
        threadpar.all_to_all_single(
            out, send,
            output_split_sizes=[rows(s, r).shape[0] for s in range(world)],
            input_split_sizes=[rows(r, d).shape[0] for d in range(world)],
        )  # fmt: skip
        return to_host(out)

    for r, out in enumerate(on_the_double(body, world, processes)):
        torch.testing.assert_close(out, torch.cat([rows(s, r) for s in range(world)]))


@pytest.mark.parametrize("processes", [1, 2])
def test_torch_batch_isend_irecv_around_a_ring(processes):
    def body():
        rank, world, dev = dist.get_rank(), dist.get_world_size(), threadpar.get_device()
        right, left = (rank + 1) % world, (rank - 1) % world
        got_left, got_right = torch.empty(3, device=dev), torch.empty(3, device=dev)
        ops = [
            dist.P2POp(dist.isend, torch.full((3,), float(rank), device=dev), right),
            dist.P2POp(dist.irecv, got_left, left),
            dist.P2POp(dist.isend, torch.full((3,), 10.0 + rank, device=dev), left),
            dist.P2POp(dist.irecv, got_right, right),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return to_host((got_left, got_right))

    for r, (left, right) in enumerate(on_the_double(body, 4, processes)):
        torch.testing.assert_close(left, torch.full((3,), float((r - 1) % 4)))
        torch.testing.assert_close(right, torch.full((3,), 10.0 + (r + 1) % 4))


def test_exchange_refuses_a_pair_not_connected_naming_the_fix():
    def body():
        g, r, dev = threadpar.get_group(), threadpar.get_rank(), threadpar.get_device()
        one, empty = torch.ones(1, device=dev), torch.empty(1, device=dev)
        with pytest.raises(ConfigError, match=r"rank 0 -> rank 1 is not connected.*group.connect"):
            g.exchange(sends=[(1, one)]) if r == 0 else g.exchange(recvs=[(0, empty)])
        with pytest.raises(ConfigError, match="cannot exchange with itself"):
            g.exchange(sends=[(r, one)])
        g.connect([(0, 1), (1, 0)])
        x = torch.full((2,), float(r), device=dev)
        y = torch.empty(2, device=dev)
        g.exchange(sends=[(1 - r, x)], recvs=[(1 - r, y)]).wait()  # crossing, in one group: no deadlock
        return y.tolist()

    assert run_fake_gpus(body, 2, FakeCuda()) == [[1.0, 1.0], [0.0, 0.0]]


def test_permute_checks_its_arguments():
    def body():
        g, dev = threadpar.get_group(), threadpar.get_device()
        one, two = torch.ones(1, device=dev), torch.ones(2, device=dev)
        with pytest.raises(ConfigError, match="permutation"):
            g.permute([one], [one.clone()], [0, 0])
        with pytest.raises(
            ConfigError, match=r"outputs\[0\] is float32\[2\] but inputs\[0\] is float32\[1\]"
        ):
            g.permute([one], [two], [1, 0])

    run_fake_gpus(body, 2, FakeCuda())
