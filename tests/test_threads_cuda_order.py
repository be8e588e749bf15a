"""The `threads` backend on CUDA tensors (several ranks sharing a GPU) orders cross-rank accesses with events.

On the CUDA test double every rank thread computes on its own stream, so without events nothing orders one
rank's kernels against another's: each test checks, with the double's model of stream order and event
edges, that a rank's work after a collective or a receive is ordered after every peer's work before it.
"""

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
import threadpar.comm.threads.group as threads_backend
from threadpar.comm.common.cuda_seam import CudaApi, NcclRuntime
from threadpar.comm.threads.stream_order import StreamOrder
from threadpar.runtime.world import World


@pytest.mark.parametrize("path", ["one_thread", "split"])
def test_collectives_order_every_peers_earlier_work_before_each_ranks_later_work(path, monkeypatch):
    monkeypatch.setattr(threads_backend, "SMALL_BYTES", 1 << 40 if path == "one_thread" else -1)
    fake = FakeCuda()

    def body():
        device = threadpar.get_device()
        stream = fake.current_stream(device)
        rank, marks = threadpar.get_rank(), []
        t = torch.full((6,), float(rank), device=device)
        for op in ("all_reduce", "all_gather", "broadcast"):
            before = fake.mark(stream, f"{op} input")
            if op == "all_reduce":
                threadpar.all_reduce(t)
            elif op == "all_gather":
                threadpar.all_gather([torch.empty(6, device=device) for _ in range(3)], t)
            else:
                threadpar.broadcast(t, src=2)
            marks.append((before, fake.mark(stream, f"after {op}")))
        return marks

    marks = run_fake_gpus(body, 3, fake, backend="threads")
    for step in range(3):
        for rank in range(3):
            for peer in range(3):
                assert fake.ordered(marks[peer][step][0], marks[rank][step][1]), (step, rank, peer)
            assert not fake.ordered(marks[rank][step][1], marks[rank][step][0])


def test_a_received_message_is_ordered_after_the_senders_copy():
    fake = FakeCuda()

    def body():
        device = threadpar.get_device()
        stream = fake.current_stream(device)
        if threadpar.get_rank() == 0:
            produced = fake.mark(stream, "produce")
            threadpar.send(torch.arange(3.0, device=device), dst=1)
            return produced
        got = threadpar.get_group().recv_tensor(src=0)
        assert got.device == device and torch.equal(got.cpu(), torch.arange(3.0))
        assert any(t.refers_to(got) for t, _ in fake.recorded)  # kept alive for the receiver's stream
        return fake.mark(stream, "consume")

    produced, consumed = run_fake_gpus(body, 2, fake, backend="threads")
    assert fake.ordered(produced, consumed)


def test_threads_groups_get_stream_ordering_only_on_cuda_devices():
    def world(device):
        return World(
            layout=threadpar.Layout.build(2),
            backend="threads",
            devices=(torch.device(device),) * 2,
            timeout=1.0,
            seed=0,
            intraop_threads=1,
        )

    assert isinstance(world("cuda:0").world_group().backend._order, StreamOrder)  # two ranks on one GPU
    assert world("cpu").world_group().backend._order is None


CUDA_PRIMITIVES = sorted(n for n, v in vars(CudaApi).items() if callable(v) and not n.startswith("_"))


class CudaPrimitivesOnly:
    """The CudaApi members of a FakeCuda and nothing else: no NCCL library, lock, pools or error query.

    Each primitive is a method of the class, not an attribute found by __getattr__: from Python 3.12 on,
    isinstance() with a runtime-checkable Protocol looks members up with inspect.getattr_static, which
    never calls __getattr__ (What's New in Python 3.12, typing: gh-102433), so a forwarding proxy is no
    CudaApi there."""

    autograd_thread = False  # run_fake_gpus's own mode switch (the double's harness, not a CUDA primitive)

    def __init__(self, fake: FakeCuda) -> None:
        self._fake = fake

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str, sync: bool, index: int) -> None:
        """The double's model of a host <-> device copy (sim_gpu.CopyModel): its device, not a CUDA primitive."""
        self._fake.copy(dst, src, what, sync, index)


def _forward(name: str):
    def primitive(self: CudaPrimitivesOnly, *args, **kwargs):
        return getattr(self._fake, name)(*args, **kwargs)

    primitive.__name__ = name
    return primitive


for _name in CUDA_PRIMITIVES:
    setattr(CudaPrimitivesOnly, _name, _forward(_name))


def test_the_threads_backend_orders_streams_with_the_cuda_primitives_alone():
    """The threads backend's stream order takes a CudaApi only: a seam without the NCCL runtime serves it,
    and the order still holds (the nccl backend is the only one that asks for an NcclRuntime)."""
    fake = FakeCuda()
    primitives = CudaPrimitivesOnly(fake)
    assert isinstance(primitives, CudaApi) and not isinstance(primitives, NcclRuntime)

    def body():
        device = threadpar.get_device()
        stream = fake.current_stream(device)
        t = torch.full((4,), float(threadpar.get_rank()), device=device)
        before = fake.mark(stream, "input")
        threadpar.all_reduce(t)
        return before, fake.mark(stream, "after"), t.cpu()

    results = run_fake_gpus(body, 2, primitives, backend="threads")
    for _, after, t in results:
        torch.testing.assert_close(t, torch.full((4,), 1.0))
        assert all(fake.ordered(before, after) for before, _, _ in results)
