"""One contract, two implementations: the same assertions on the NCCL double (on its GPU `simgpu:0`, every CI
run) and on the real NCCL through threadpar's binding (`pytest -m cuda` on `cuda:0`, one GPU is enough), so
each GPU run also checks the double. World-1 communicators, because a one-GPU machine cannot hold two ranks of one communicator (NCCL
refuses it: the duplicate-device case below is itself part of the contract). The double's multi-rank rules
are in test_nccl_double.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda
from helpers.gpus import gpu_count

from threadpar.comm.nccl.library import AVG, IN_PROGRESS, MAX, SUM, UNIQUE_ID_BYTES, nccl_group
from threadpar.errors import NcclError


@dataclass
class Contract:
    """What a test needs from either side: the API, where tensors live, a comm stream, and a host wait."""

    api: Any
    device: torch.device
    stream: Any
    sync: Callable[[], None]

    def tensor(self, values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


@pytest.fixture(params=["double", pytest.param("nccl", marks=pytest.mark.cuda)])
def contract(request) -> Iterator[Contract]:
    if request.param == "double":
        fake = FakeCuda()  # (this thread is on fake GPU 0, as the communicators below)
        device = sim_gpu.device(0)  # (the double's GPU 0: NCCL's buffers are device memory)
        yield Contract(fake.nccl, device, fake.pool_stream(device, 0), lambda: fake.synchronize(device))
        assert not fake.nccl.violations
        return
    if not gpu_count():
        pytest.skip("needs a CUDA GPU")
    from threadpar.comm.nccl.library import nccl_library

    device = torch.device("cuda", 0)
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        yield Contract(nccl_library(), device, stream, lambda: stream.synchronize())


def one_rank(c: Contract, init_all: bool = False) -> Any:
    if init_all:
        (comm,) = c.api.comm_init_all([0])
        return comm
    return c.api.comm_init_rank(1, c.api.get_unique_id(), 0, 0)


def test_version_and_unique_ids(contract):
    major, minor, patch = contract.api.version()
    assert (major, minor) >= (2, 10) and patch >= 0
    a, b = contract.api.get_unique_id(), contract.api.get_unique_id()
    assert len(a) == len(b) == UNIQUE_ID_BYTES and a != b


@pytest.mark.parametrize("init_all", [False, True], ids=["init_rank", "init_all"])
def test_a_world_of_one_runs_every_collective(contract, init_all):
    c, comm = contract, one_rank(contract, init_all)
    x = c.tensor([1.0, -2.0, 3.0])
    out = torch.empty_like(x)
    c.api.all_reduce(x, out, SUM, comm, c.stream)
    c.api.all_reduce(x, x, MAX, comm, c.stream)  # in place
    avg = torch.empty_like(x)
    c.api.all_reduce(x, avg, AVG, comm, c.stream)
    bcast = torch.empty_like(x)
    c.api.broadcast(x, bcast, 0, comm, c.stream)
    red = torch.empty_like(x)
    c.api.reduce(x, red, 0, SUM, comm, c.stream)
    gathered = torch.empty(3, device=c.device)
    c.api.all_gather(x, gathered, comm, c.stream)
    scattered = torch.empty(3, device=c.device)
    c.api.reduce_scatter(x, scattered, SUM, comm, c.stream)
    halves = c.tensor([0.5, 1.5], dtype=torch.bfloat16)
    c.api.all_reduce(halves, halves, SUM, comm, c.stream)
    c.sync()
    for got in (out, x, avg, bcast, red, gathered, scattered):
        torch.testing.assert_close(got.cpu(), torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(halves.cpu(), torch.tensor([0.5, 1.5], dtype=torch.bfloat16))
    assert c.api.comm_get_async_error(comm) == 0
    c.api.comm_destroy(comm)


def test_a_rank_sends_to_itself_inside_a_group(contract):
    c, comm = contract, one_rank(contract)
    src, dst = c.tensor([4.0, 5.0]), c.tensor([0.0, 0.0])
    with nccl_group(c.api):
        c.api.send(src, 0, comm, c.stream)
        c.api.recv(dst, 0, comm, c.stream)
    c.sync()
    torch.testing.assert_close(dst.cpu(), torch.tensor([4.0, 5.0]))
    c.api.comm_destroy(comm)


def test_groups_nest_and_an_end_without_a_start_is_invalid_usage(contract):
    c, comm = contract, one_rank(contract)
    x = c.tensor([1.0, 2.0])
    c.api.group_start()
    c.api.group_start()
    c.api.all_reduce(x, x, SUM, comm, c.stream)
    c.api.group_end()
    c.api.group_end()
    c.sync()
    torch.testing.assert_close(x.cpu(), torch.tensor([1.0, 2.0]))
    with pytest.raises(NcclError, match="ncclGroupEnd failed: ncclInvalidUsage"):
        c.api.group_end()
    c.api.comm_destroy(comm)


def test_a_root_outside_the_communicator_is_an_invalid_argument(contract):
    c, comm = contract, one_rank(contract)
    x = c.tensor([1.0])
    with pytest.raises(NcclError, match="ncclBroadcast failed: ncclInvalidArgument"):
        c.api.broadcast(x, x, 1, comm, c.stream)
    c.api.comm_destroy(comm)


def test_two_ranks_of_one_communicator_on_one_device_are_refused(contract):
    """NCCL refuses a communicator with two ranks on one GPU (src/init.cc: "Duplicate GPU detected"), which
    is why ranks sharing a GPU use the threads backend."""
    with pytest.raises(NcclError, match="ncclInvalidUsage"):
        contract.api.comm_init_all([0, 0])


def test_abort_frees_a_communicator(contract):
    c, comm = contract, one_rank(contract)
    x = c.tensor([1.0])
    c.api.all_reduce(x, x, SUM, comm, c.stream)
    c.sync()
    c.api.comm_abort(comm)  # (using it afterwards is a use-after-free on real NCCL: the double refuses it)


def _settled(c: Contract, comm: Any) -> int:
    """Poll ncclCommGetAsyncError until a nonblocking communicator's last call is done (nccl.h)."""
    deadline = time.monotonic() + 60
    while (state := c.api.comm_get_async_error(comm)) == IN_PROGRESS:
        assert time.monotonic() < deadline, "a nonblocking communicator stayed in progress for 60 s"
        time.sleep(0.001)
    return state


def test_a_nonblocking_communicator_is_used_once_its_state_says_success(contract):
    """ncclCommInitRankConfig with config.blocking = 0 (threadpar's point-to-point communicators): it returns
    at once, and is ready once ncclCommGetAsyncError says ncclSuccess; a group end on it may return
    ncclInProgress, after which the state is polled again (user guide, api/comms.html)."""
    c = contract
    comm = c.api.comm_init_rank_config(1, c.api.get_unique_id(), 0, 0, False)
    assert _settled(c, comm) == 0
    x = c.tensor([1.0, 2.0])
    c.api.group_start()
    c.api.all_reduce(x, x, SUM, comm, c.stream)
    assert c.api.group_end() in (0, IN_PROGRESS)
    assert _settled(c, comm) == 0
    c.sync()
    torch.testing.assert_close(x.cpu(), torch.tensor([1.0, 2.0]))
    c.api.comm_abort(comm)  # (nonblocking: abort is allowed at any point)


def test_empty_messages_travel_in_a_group(contract):
    """Zero-byte sends and receives match like any other (NCCL >= 2.12.10; torch sends them rather than
    skipping them, so that every rank's calls match: torch/csrc/cuda/nccl.cpp, _nccl_should_send_recv)."""
    c, comm = contract, one_rank(contract)
    empty_out, empty_in = c.tensor([]), c.tensor([])
    with nccl_group(c.api):
        c.api.send(empty_out, 0, comm, c.stream)
        c.api.recv(empty_in, 0, comm, c.stream)
    c.sync()
    assert c.api.comm_get_async_error(comm) == 0
    c.api.comm_destroy(comm)


def test_a_pre_multiplied_sum_scales_each_input_by_its_scalar_in_the_data_type(contract):
    # ncclRedOpCreatePreMulSum (NCCL 2.11+), the scalar on the host: fp16 AVG over groups whose size is not a
    # power of two (nccl/reduction.py). 40000 * 0.25 is exact; the scalar is held in fp16 (1/3 rounds).
    c, comm = contract, one_rank(contract)
    quarter = c.api.red_op_create_pre_mul_sum(0.25, torch.float16, comm)
    third = c.api.red_op_create_pre_mul_sum(1 / 3, torch.float16, comm)
    assert quarter >= 5 and third >= 5 and quarter != third  # (ncclNumOps = 5 built-in values before them)
    x = c.tensor([4.0, 40000.0, -6.0], dtype=torch.float16)
    out, thirds = torch.empty_like(x), torch.empty_like(x)
    c.api.all_reduce(x, out, quarter, comm, c.stream)
    c.api.reduce_scatter(x, thirds, third, comm, c.stream)
    c.sync()
    torch.testing.assert_close(
        out.cpu(), torch.tensor([1.0, 10000.0, -1.5], dtype=torch.float16), rtol=0, atol=0
    )
    third_in_fp16 = torch.tensor(1 / 3, dtype=torch.float16)
    torch.testing.assert_close(thirds.cpu(), x.cpu() * third_in_fp16, rtol=0, atol=0)
    c.api.red_op_destroy(quarter, comm)
    c.api.red_op_destroy(third, comm)
    c.api.comm_destroy(comm)


def test_a_user_created_op_is_refused_with_another_dtype_another_communicator_or_once_destroyed(contract):
    # src/enqueue.cc, hostToDevRedOp ("Data type supplied to user-created ncclRedOp_t does not match type");
    # src/misc/argcheck.cc, ArgsCheck ("reduction operation %d unknown to this communicator"); src/enqueue.cc,
    # ncclRedOpDestroy (a built-in op, one unknown to the communicator): all ncclInvalidArgument.
    c, comm, other = contract, one_rank(contract), one_rank(contract)
    op = c.api.red_op_create_pre_mul_sum(0.5, torch.bfloat16, comm)
    halves, floats = c.tensor([2.0], dtype=torch.bfloat16), c.tensor([2.0])
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        c.api.all_reduce(floats, floats, op, comm, c.stream)  # made for bfloat16
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        c.api.all_reduce(halves, halves, op, other, c.stream)  # made on `comm`
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        c.api.red_op_destroy(SUM, comm)  # a built-in
    c.api.all_reduce(halves, halves, op, comm, c.stream)
    c.api.red_op_destroy(op, comm)  # (allowed once the calls given it have returned: nccl.h)
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        c.api.all_reduce(halves, halves, op, comm, c.stream)
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        c.api.red_op_destroy(op, comm)
    c.sync()
    torch.testing.assert_close(halves.cpu(), torch.tensor([1.0], dtype=torch.bfloat16))
    c.api.comm_destroy(comm)
    c.api.comm_destroy(other)
