"""More of the NCCL contract (tests/test_nccl_contract.py's fixture: the same assertions on the double, every CI
run, and on the real NCCL through threadpar's binding, `pytest -m cuda`): the double's argument rules and its
ncclAvg arithmetic, each as NCCL's source has it (tests/fakes/rules.py names them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda
from helpers.gpus import gpu_count
from test_nccl_contract import Contract, contract, one_rank  # noqa: F401  (the fixture, shared)

from threadpar.comm.nccl.library import AVG, SUM, UNIQUE_ID_BYTES, nccl_group
from threadpar.errors import NcclError


def test_a_rank_outside_the_communicator_is_an_invalid_argument_at_init(contract: Contract):  # noqa: F811
    """src/init.cc, ncclCommInitRankDev: `myrank < 0 || myrank >= nranks` -> "Invalid rank requested",
    ncclInvalidArgument, before the unique id is used (so none is made here)."""
    unused_id = bytes(UNIQUE_ID_BYTES)
    for rank in (1, -1):
        with pytest.raises(NcclError, match="ncclCommInitRank failed: ncclInvalidArgument"):
            contract.api.comm_init_rank(1, unused_id, rank, 0)


def test_a_reduction_nccl_does_not_have_is_an_invalid_argument(contract: Contract):  # noqa: F811
    """src/misc/argcheck.cc, ArgsCheck (at the call): an op below 0 is "invalid reduction operation"; one at or
    past ncclNumOps (5) that no ncclRedOpCreatePreMulSum made is "unknown to this communicator"; both
    ncclInvalidArgument."""
    c, comm = contract, one_rank(contract)
    x = c.tensor([1.0, 2.0])
    for op in (5, -1):
        with pytest.raises(NcclError, match="ncclAllReduce failed: ncclInvalidArgument"):
            c.api.all_reduce(x, x, op, comm, c.stream)
    c.api.all_reduce(x, x, SUM, comm, c.stream)  # (the communicator is still good)
    c.sync()
    torch.testing.assert_close(x.cpu(), torch.tensor([1.0, 2.0]))
    c.api.comm_destroy(comm)


def test_a_dtype_nccl_has_no_type_for_is_refused_before_the_call(contract: Contract):  # noqa: F811
    """ncclDataType_t (nccl.h) has no complex type: threadpar's binding refuses it (library.data_type), and the
    double as it does."""
    c, comm = contract, one_rank(contract)
    x = c.tensor([1.0, 2.0], dtype=torch.complex64)
    with pytest.raises(NcclError, match=r"no data type for torch\.complex64"):
        c.api.all_reduce(x, x, SUM, comm, c.stream)
    c.api.comm_destroy(comm)


def test_sends_to_one_peer_match_its_receives_in_issue_order(contract: Contract):  # noqa: F811
    """usage/p2p.html: the k-th ncclRecv from a peer receives the k-th ncclSend of that peer to this rank (here
    a rank and itself, inside one group); the sizes differ, so an other order could not pass."""
    c, comm = contract, one_rank(contract)
    first, second = c.tensor([1.0, 2.0]), c.tensor([3.0, 4.0, 5.0])
    got_first, got_second = c.tensor([0.0, 0.0]), c.tensor([0.0, 0.0, 0.0])
    with nccl_group(c.api):
        c.api.send(first, 0, comm, c.stream)
        c.api.send(second, 0, comm, c.stream)
        c.api.recv(got_first, 0, comm, c.stream)
        c.api.recv(got_second, 0, comm, c.stream)
    c.sync()
    torch.testing.assert_close(got_first.cpu(), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(got_second.cpu(), torch.tensor([3.0, 4.0, 5.0]))
    c.api.comm_destroy(comm)


@dataclass
class Ranks:
    """Three ranks of one communicator driven from this thread (ncclCommInitAll): the API, each rank's device
    and stream, and a host wait for all of them."""

    api: Any
    devices: list[torch.device]
    streams: list[Any]
    sync: Callable[[], None]


@pytest.fixture(params=["double", pytest.param("nccl", marks=pytest.mark.cuda)])
def three(request) -> Iterator[Ranks]:
    if request.param == "double":
        fake = FakeCuda()
        devices = [sim_gpu.device(i) for i in range(3)]
        yield Ranks(
            fake.nccl, devices, [fake.pool_stream(d, 0) for d in devices], lambda: fake.run_everything()
        )
        assert not fake.nccl.violations
        return
    if gpu_count() < 3:
        pytest.skip(
            f"needs 3 GPUs (an average over a world whose 1/n is inexact); this machine has {gpu_count()}"
        )
    from threadpar.comm.nccl.library import nccl_library

    devices = [torch.device("cuda", i) for i in range(3)]
    streams = [torch.cuda.Stream(device=d) for d in devices]

    def sync() -> None:
        for stream in streams:
            stream.synchronize()

    yield Ranks(nccl_library(), devices, streams, sync)


def test_avg_over_three_ranks_is_nccls_premultiplied_sum(three: Ranks):
    """src/enqueue.cc, hostToDevRedOp: ncclAvg on a float type is ncclDevPreMulSum by 1/n held in the type, so
    float16 inputs of 60000 on 3 ranks are 3 x fp16(60000 x fp16(1/3)) = 60000, where a sum before the division
    would overflow float16 (65504) to inf; on integers it is ncclDevSumPostDiv, C's division of the sum (towards
    zero: -4 / 3 is -1)."""
    comms = three.api.comm_init_all([d.index for d in three.devices])
    halves = [torch.full((4,), 60000.0, dtype=torch.float16, device=d) for d in three.devices]
    ints = [
        torch.tensor([1, -1], dtype=torch.int32, device=d) * (2 if i == 2 else 1)
        for i, d in enumerate(three.devices)
    ]
    with nccl_group(three.api):
        for i, comm in enumerate(comms):
            three.api.all_reduce(halves[i], halves[i], AVG, comm, three.streams[i])
            three.api.all_reduce(ints[i], ints[i], AVG, comm, three.streams[i])
    three.sync()
    for half, whole in zip(halves, ints):
        torch.testing.assert_close(half.cpu(), torch.full((4,), 60000.0, dtype=torch.float16), rtol=0, atol=0)
        torch.testing.assert_close(whole.cpu(), torch.tensor([1, -1], dtype=torch.int32))
    for comm in comms:
        three.api.comm_destroy(comm)
