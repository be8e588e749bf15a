"""No collective keeps a tensor alive after it completed (issue 22): not its own Work, not the rendezvous slot
the members met in (every member's payload), not the comm worker, on the threads backend and on the nccl
backend over the CUDA/NCCL double (whose own logs hold no strong references either).

Each rank posts every collective asynchronously, keeps the Works (as DDP's reducer keeps its buckets'), waits
for them, meets the others at a barrier, drops its own references, and checks through weak references that the
tensors are gone. all_reduce and broadcast are in place, and torch's Work.result() returns their tensors
(the threads backend keeps them as the Work's result, as torch's ProcessGroup does): those are checked once
the Works are dropped too, which still catches a peer's slot or the worker keeping them. The tensors are on
the rank's device (the double's GPUs on nccl); what must be gone is their memory too (`sim_gpu.host`: a device
tensor's is a host tensor of its own, which the double's logs must not keep either).
"""

import weakref

import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar import ReduceOp
from threadpar.testing import run_ranks

N = 1 << 16  # above the threads backend's SMALL_BYTES: every member does its share


def refs(*tensors: torch.Tensor) -> list[weakref.ref]:
    """Weak references to each tensor and to its memory (the same tensor on the host)."""
    return [
        weakref.ref(r) for t in tensors for r in {id(t): t, id(sim_gpu.host(t)): sim_gpu.host(t)}.values()
    ]


def collectives() -> tuple[list, list, list]:
    """Run every collective async; returns (Works, weak refs of tensors the Works may hold, the others)."""
    g, dev = threadpar.get_group(), threadpar.get_device()
    P, me = g.size(), g.rank()
    works, held, free = [], [], []
    reduced = torch.full((N,), float(me), device=dev)
    works.append(g.all_reduce(reduced, ReduceOp.SUM, async_op=True))
    held += refs(reduced)
    source = torch.full((N,), float(me), device=dev)
    works.append(g.broadcast(source, src=g.ranks[0], async_op=True))
    held += refs(source)
    scattered_in, scattered_out = torch.ones(P * N, device=dev), torch.empty(N, device=dev)
    works.append(g.reduce_scatter_tensor(scattered_out, scattered_in, ReduceOp.AVG, async_op=True))
    gathered_in, gathered_out = torch.full((N,), float(me), device=dev), torch.empty(P * N, device=dev)
    works.append(g.all_gather_into_tensor(gathered_out, gathered_in, async_op=True))
    flat = torch.zeros(P * N, device=dev)  # in place: the input is this rank's slice of the output
    works.append(g.all_gather_into_tensor(flat, flat[me * N : (me + 1) * N], async_op=True))
    free += refs(scattered_in, scattered_out, gathered_in, gathered_out, flat)
    for work in works:
        work.wait()
    assert torch.equal(scattered_out, torch.ones(N, device=dev))
    assert torch.equal(gathered_out.view(P, N)[:, 0], torch.arange(P, dtype=torch.float32, device=dev))
    return works, held, free


def check_released() -> list[str]:
    works, held, free = collectives()
    for work in works:  # completed on the device too (the double's comm streams), before dropping anything
        work.synchronize()
    threadpar.barrier()  # every member is past every collective
    leaks = [f"input/output #{i}" for i, ref in enumerate(free) if ref() is not None]
    del works
    threadpar.barrier()
    leaks += [f"in-place tensor #{i}" for i, ref in enumerate(held) if ref() is not None]
    return leaks


def test_threads_backend_keeps_no_payload():
    assert run_ranks(check_released, 2) == [[], []]


def test_nccl_backend_keeps_no_payload():
    fake = FakeCuda()
    assert run_fake_gpus(check_released, 2, fake) == [[], []]
    assert not fake.races
