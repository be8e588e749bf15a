"""torch.distributed code on rank threads, with `import threadpar as dist` as the only change (issue 19).

THIRTEEN_CALLS are the calls the issue found failing (12) or silently wrong (1), each checked against the
result torch defines; the other tests cover the functions threadpar lacked and the bad input around them.
"""

import datetime
import functools
import pickle

import pytest
import torch
import torch.distributed
from fakes import sim_gpu
from fakes.sim_gpu import to_host

import threadpar as dist
from threadpar import ConfigError, ReduceOp
from threadpar.parallel import DistributedDataParallel as DDP
from threadpar.testing import TEST_CONFIG, run_ranks

SUBGROUP = [1, 3]  # of a world of 4: group rank 0 is global rank 1, group rank 1 is global rank 3


def _in_subgroup(body):
    """Run body(group, group_rank) on the members of new_group(SUBGROUP); the others skip it."""
    group = dist.new_group(SUBGROUP)
    if dist.get_rank() in SUBGROUP:
        return body(group, group.rank())
    return None


def call_broadcast_group_src(group, me):
    t = torch.full((3,), float(dist.get_rank()))
    dist.broadcast(t, group=group, group_src=1)
    torch.testing.assert_close(t, torch.full((3,), 3.0))  # group rank 1 is global rank 3


def call_reduce_group_dst(group, me):
    t = torch.full((2,), float(dist.get_rank()))
    dist.reduce(t, group=group, group_dst=0)
    if me == 0:
        torch.testing.assert_close(t, torch.full((2,), 1.0 + 3.0))


def call_gather_group_dst(group, me):
    t = torch.tensor([dist.get_rank()])
    out = [torch.empty(1, dtype=torch.int64) for _ in range(2)] if me == 1 else None
    dist.gather(t, out, group=group, group_dst=1)
    if me == 1:
        assert [o.item() for o in out] == SUBGROUP


def call_scatter_group_src(group, me):
    t = torch.empty(1, dtype=torch.int64)
    chunks = [torch.tensor([10]), torch.tensor([30])] if me == 0 else None
    dist.scatter(t, chunks, group=group, group_src=0)
    assert t.item() == 10 * SUBGROUP[me]


def call_send_recv_group_peer(group, me):
    if me == 0:
        dist.send(torch.tensor([7.0]), group=group, group_dst=1)
    else:
        t = torch.empty(1)
        assert dist.recv(t, group=group, group_src=0) == 1  # the sender's global rank, as torch returns
        assert t.item() == 7.0


def call_isend_irecv_group_peer(group, me):
    if me == 1:
        dist.isend(torch.tensor([5.0]), group=group, group_dst=0).wait()
    else:
        t = torch.empty(1)
        dist.irecv(t, group=group, group_src=1).wait()
        assert t.item() == 5.0


def call_barrier_device_ids_timeout(group, me):
    # A CPU rank: torch's gloo ignores device_ids; the timeout bounds the wait.
    dist.barrier(group, device_ids=[0], timeout=datetime.timedelta(seconds=30))


def call_new_group_keywords(group, me):
    g = dist.new_group(
        SUBGROUP, backend="gloo", timeout=datetime.timedelta(seconds=30), use_local_synchronization=True
    )
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert t.item() == 2.0


def call_ddp_device_ids(group, me):
    torch.manual_seed(0)  # (no draws below: the model's init comes from the rank's own generator)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.normal_(generator=dist.get_generator())
    ddp = DDP(model, device_ids=None, process_group=group)  # a CPU module: device_ids=None, as torch
    x = torch.full((1, 2), float(dist.get_rank()))
    ddp(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), (1.0 + 3.0) / 2))


def call_bitwise_ops(group, me):
    for op, expect in [(ReduceOp.BAND, 1 & 3), (ReduceOp.BOR, 1 | 3), (ReduceOp.BXOR, 1 ^ 3)]:
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t, op=op, group=group)
        assert t.item() == expect, op


def call_torch_bitwise_op(group, me):
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t, op=torch.distributed.ReduceOp.BXOR, group=group)  # torch's own enum value
    assert t.item() == 1 ^ 3


def call_new_group_positional_timeout(group, me):
    g = dist.new_group(SUBGROUP, datetime.timedelta(seconds=30))
    assert isinstance(g.name, str) and g.ranks == tuple(SUBGROUP)
    assert g._state.timeout == 30.0


THIRTEEN_CALLS = [
    call_broadcast_group_src,
    call_reduce_group_dst,
    call_gather_group_dst,
    call_scatter_group_src,
    call_send_recv_group_peer,
    call_isend_irecv_group_peer,
    call_barrier_device_ids_timeout,
    call_new_group_keywords,
    call_ddp_device_ids,
    call_bitwise_ops,
    call_torch_bitwise_op,
    call_new_group_positional_timeout,
]


def test_the_calls_the_issue_found_failing():
    def body():
        for call in THIRTEEN_CALLS:
            _in_subgroup(call)

    run_ranks(body, 4)


def test_group_src_and_src_together_or_neither_is_an_error():
    def body():
        t = torch.zeros(1)
        with pytest.raises(ConfigError, match="not both"):
            dist.broadcast(t, src=0, group_src=0)
        with pytest.raises(ConfigError, match=r"pass src= .* or group_src="):
            dist.broadcast(t)
        with pytest.raises(ConfigError, match="group rank 2 is not in group"):
            dist.send(t, group=dist.new_group([0, 1]), group_dst=2)

    run_ranks(body, 2)


def test_gather_and_scatter_default_to_global_rank_0_as_torch():
    def body():
        rank = dist.get_rank()
        out = [torch.empty(1) for _ in range(2)] if rank == 0 else None
        dist.gather(torch.tensor([float(rank)]), out)
        if rank == 0:
            assert [o.item() for o in out] == [0.0, 1.0]

    run_ranks(body, 2)


# bitwise reductions --------------------------------------------------------------------------------------------
BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}
BIT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool]


def _bits(rank, dtype, n=6, device=None):
    """Rank `rank`'s random bits, made on the host (the same on every backend), on `device`."""
    g = torch.Generator().manual_seed(rank + 17)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().to(device)
    low, high = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(low, high, (n,), generator=g).to(device, dtype)


def _bit_reference(world, dtype, op):
    return functools.reduce(BITWISE[op], [_bits(r, dtype) for r in range(world)])


def _bitwise_workload():
    world, rank, device = dist.get_world_size(), dist.get_rank(), dist.get_device()
    got = {}
    for dtype in BIT_DTYPES:
        for op in BITWISE:
            t = _bits(rank, dtype, device=device)
            dist.all_reduce(t, op=op)
            got["all_reduce", dtype, op] = t
            t = _bits(rank, dtype, device=device)
            dist.reduce(t, dst=world - 1, op=op)
            if rank == world - 1:
                got["reduce", dtype, op] = t
            rows = torch.cat(
                [_bits(rank, dtype, device=device)] * world
            )  # each member's chunk: its whole input
            out = torch.empty(6, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(out, rows, op=op)
            got["reduce_scatter", dtype, op] = out
    with pytest.raises(ConfigError, match="bitwise op: it needs an integer or bool tensor"):
        dist.all_reduce(torch.ones(2, device=device), op=ReduceOp.BAND)
    return got


def _check_bitwise(results, world):
    for got in to_host(results):
        for (kind, dtype, op), t in got.items():
            torch.testing.assert_close(
                t, _bit_reference(world, dtype, op), rtol=0, atol=0, msg=f"{kind} {op}"
            )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_ops_match_a_single_thread_reference_on_threads(world):
    _check_bitwise(run_ranks(_bitwise_workload, world), world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_ops_match_a_single_thread_reference_on_the_nccl_double(world):
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    _check_bitwise(run_fake_gpus(_bitwise_workload, world, FakeCuda()), world)


def test_the_nccl_double_refuses_a_bitwise_op_as_nccl_does():
    """NCCL has no bitwise reduction: a bitwise ncclRedOp_t never reaches it (threadpar gathers the bytes)."""
    from fakes.fake_cuda_nccl import FakeCuda

    fake = FakeCuda()
    nccl = fake.nccl
    comm = nccl.comm_init_rank(1, nccl.get_unique_id(), 0, 0)
    x = torch.ones(1, dtype=torch.int32, device=sim_gpu.device(0))
    stream = fake.pool_stream(sim_gpu.device(0), 0)
    # past ncclAvg (4) only ops of ncclRedOpCreatePreMulSum: src/misc/argcheck.cc, ArgsCheck
    with pytest.raises(
        RuntimeError,
        match=r"ncclAllReduce failed: ncclInvalidArgument \(reduction operation 5 unknown to this communicator",
    ):
        nccl.all_reduce(x, x, 5, comm, stream)
    nccl.comm_destroy(comm)


# object collectives --------------------------------------------------------------------------------------------
def _object_workload():
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"rank": rank, "payload": list(range(rank * 3))}  # a different pickled size on every rank
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    out = {"all_gather": everyone}
    objects = [("from", rank), {"n": rank}] if rank == world - 1 else [None, None]
    dist.broadcast_object_list(objects, group_src=world - 1)
    out["broadcast"] = objects
    gathered = [None] * world if rank == 1 else None
    dist.gather_object(mine, gathered, dst=1)
    out["gather"] = gathered
    received = [None]
    inputs = [f"to {r}" * (r + 1) for r in range(world)] if rank == 0 else None
    dist.scatter_object_list(received, inputs, src=0)
    out["scatter"] = received[0]
    return out


def _check_objects(results, world):
    expected = [{"rank": r, "payload": list(range(r * 3))} for r in range(world)]
    for rank, out in enumerate(results):
        assert out["all_gather"] == expected
        assert out["broadcast"] == [("from", world - 1), {"n": world - 1}]
        assert out["gather"] == (expected if rank == 1 else None)
        assert out["scatter"] == f"to {rank}" * (rank + 1)


def test_object_collectives_on_threads():
    _check_objects(run_ranks(_object_workload, 3), 3)


def test_object_collectives_on_the_nccl_double():
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    _check_objects(run_fake_gpus(_object_workload, 3, FakeCuda()), 3)


def test_object_collectives_copy_and_check_their_lists():
    def body():
        shared = [1, 2]
        everyone = [None, None]
        dist.all_gather_object(everyone, shared)
        assert everyone[dist.get_rank()] is not shared  # unpickled copies, as torch gives
        with pytest.raises(ConfigError, match="object_list must be a list of 2 entries"):
            dist.all_gather_object([None], 1)

    run_ranks(body, 2)


class NotAWeight:
    """A class torch.load(weights_only=True) refuses (not on its allowlist)."""


def test_object_collectives_take_weights_only():
    """torch 2.14's weights_only=True (threadpar's keyword-only extra on an older torch): torch.save on the
    way out, torch.load(weights_only=True) on the way in; tensors and plain containers pass, other classes
    are refused."""

    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {"rank": rank, "weight": torch.full((2,), float(rank))}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, weights_only=True)
        objects = [mine] if rank == 0 else [None]
        dist.broadcast_object_list(objects, src=0, weights_only=True)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, weights_only=True)
        received = [None]
        dist.scatter_object_list(received, everyone if rank == 0 else None, src=0, weights_only=True)
        with pytest.raises(pickle.UnpicklingError, match="NotAWeight"):
            dist.all_gather_object([None] * world, NotAWeight(), weights_only=True)
        return everyone, objects[0], gathered, received[0]

    results = run_ranks(body, 2)
    expected = [{"rank": r, "weight": torch.full((2,), float(r))} for r in range(2)]
    for rank, (everyone, broadcast, gathered, scattered) in enumerate(results):
        torch.testing.assert_close(everyone, expected)
        torch.testing.assert_close(broadcast, expected[0])
        if rank == 0:
            torch.testing.assert_close(gathered, expected)
        torch.testing.assert_close(scattered, expected[rank])


# point to point in batches -------------------------------------------------------------------------------------
def test_batch_isend_irecv_exchanges_around_a_ring():
    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        right, left = (rank + 1) % world, (rank - 1) % world
        got_left, got_right = torch.empty(2), torch.empty(2)
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), float(rank)), right),
            dist.P2POp(torch.distributed.irecv, got_left, left),  # torch's own function names the op too
            dist.P2POp(dist.isend, torch.full((2,), 10.0 + rank), left, tag=1),
            dist.P2POp(dist.irecv, got_right, group_peer=right, tag=1),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        torch.testing.assert_close(got_left, torch.full((2,), float(left)))
        torch.testing.assert_close(got_right, torch.full((2,), 10.0 + right))
        with pytest.raises(ConfigError, match="all ops must use the same group"):
            dist.batch_isend_irecv(
                [ops[0], dist.P2POp(dist.isend, torch.ones(1), 0, group=dist.new_group([0]))]
            )
        with pytest.raises(ConfigError, match="op must be isend or irecv"):
            dist.P2POp(dist.send, torch.ones(1), right)

    run_ranks(body, 4)


# barriers that name who is missing ------------------------------------------------------------------------------
def _missing_rank_body(wait):
    def body():
        # Every rank meets once first: across processes, a group's first collective also connects its gloo
        # groups, a wait that nothing can interrupt (issue 20's), which the missing rank would leave pending.
        dist.barrier()
        if dist.get_rank() == 2:
            dist.recv(
                torch.empty(1, device=dist.get_device()), src=0
            )  # never sent: rank 2 is "stuck" until the launch stops
        else:
            wait()

    return body


@pytest.mark.parametrize(
    "wait",
    [
        lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=0.5)),
        lambda: dist.monitored_barrier(timeout=0.5, wait_all_ranks=True),
        lambda: dist.barrier(timeout=datetime.timedelta(seconds=0.5)),
        lambda: dist.barrier(async_op=True, timeout=datetime.timedelta(seconds=0.5)).wait(),
        lambda: dist.barrier(dist.new_group([0, 1, 2], datetime.timedelta(seconds=0.5))),
    ],
    ids=["monitored", "monitored_seconds", "barrier", "barrier_async", "group_timeout"],
)
def test_a_barrier_with_a_timeout_names_the_rank_that_did_not_arrive(wait):
    with pytest.raises(dist.RankFailedError) as failed:
        dist.launch(_missing_rank_body(wait), config=TEST_CONFIG, world_size=3)
    assert isinstance(failed.value.error, dist.CollectiveTimeoutError)
    assert "timed out after 0.5 s" in str(failed.value.error)
    assert "ranks [2] did not arrive" in str(failed.value.error)


def test_a_barrier_with_a_timeout_on_the_nccl_double_names_the_missing_rank():
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    with pytest.raises(dist.CollectiveTimeoutError, match=r"after 0.5 s .*ranks \[2\] did not arrive"):
        run_fake_gpus(_missing_rank_body(lambda: dist.monitored_barrier(timeout=0.5)), 3, FakeCuda())


def test_barrier_checks_device_ids_and_timeout():
    def body():
        with pytest.raises(ConfigError, match="device_ids must be a list of one device"):
            dist.barrier(device_ids=[0, 1])
        with pytest.raises(ConfigError, match="timeout must be positive"):
            dist.barrier(timeout=datetime.timedelta(0))
        dist.barrier(device_ids=[dist.get_rank()])

    run_ranks(body, 2)


# new_group ------------------------------------------------------------------------------------------------------
def test_new_group_takes_torch_parameters():
    def body():
        world = dist.new_group()  # the world's ranks and the launch's timeout: the world group
        assert world is dist.get_group()
        g = dist.new_group([1, 0], group_desc="pair")
        assert g.ranks == (0, 1) and dist.get_group("pair") is g  # sorted, as torch; group_desc names it
        unsorted = dist.new_group([1, 0], sort_ranks=False)
        assert unsorted.ranks == (1, 0)
        timed = dist.new_group([0, 1], datetime.timedelta(seconds=30))
        assert timed is not g and timed.ranks == g.ranks and timed._state.timeout == 30.0
        assert dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30)) is timed  # the same again
        assert dist.new_group([0, 1], datetime.timedelta(seconds=TEST_CONFIG.timeout)) is g  # the launch's
        t = torch.ones(1)
        dist.all_reduce(t, group=timed)
        assert t.item() == 2.0
        with pytest.raises(ConfigError, match=r"backend='nccl' is not this launch's backend 'threads'"):
            dist.new_group([0, 1], backend="nccl")
        with pytest.raises(ConfigError, match="pass pg_options=None"):
            dist.new_group([0, 1], pg_options=object())
        with pytest.raises(ConfigError, match=r"timeout must be a datetime.timedelta"):
            dist.new_group([0, 1], "name")
        with pytest.raises(ConfigError, match=r"device_id=.*is not this rank's device cpu"):
            dist.new_group([0, 1], device_id=torch.device("cuda", 0))
        dist.new_group([0, 1], backend="cpu:gloo,cuda:nccl", device_id=torch.device("cpu"))

    run_ranks(body, 2)


# queries and init_process_group ---------------------------------------------------------------------------------
def test_group_queries_and_init_process_group():
    assert not dist.is_initialized()  # outside a rank

    def body():
        rank = dist.get_rank()
        assert dist.is_initialized()
        g = dist.new_group(SUBGROUP)
        assert dist.get_process_group_ranks(g) == SUBGROUP
        assert dist.get_global_rank(g, 1) == 3 and dist.get_group_rank(g, 3) == 1
        assert dist.get_backend() == "threads" and dist.get_backend(g) == "threads"
        with pytest.raises(ConfigError, match=r"global_rank|not a member"):
            dist.get_group_rank(g, 0)
        dist.init_process_group(
            "gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=TEST_CONFIG.timeout)
        )
        dist.init_process_group()
        with pytest.raises(ConfigError, match=rf"rank=9 but this rank thread is rank {rank} of world_size 4"):
            dist.init_process_group(rank=9)
        with pytest.raises(
            ConfigError, match=r"world_size=8 but this rank thread is rank \d of world_size 4"
        ):
            dist.init_process_group(world_size=8)
        with pytest.raises(ConfigError, match=r"pass timeout= to threadpar.launch"):
            dist.init_process_group(timeout=datetime.timedelta(seconds=1))
        dist.init_process_group(enable_reconfigure=False)  # torch 2.14's
        with pytest.raises(ConfigError, match=r"enable_reconfigure=True .* pass False"):
            dist.init_process_group(enable_reconfigure=True)
        dist.destroy_process_group()
        dist.barrier()

    run_ranks(body, 4)


# DistributedDataParallel's torch parameters ---------------------------------------------------------------------
def test_ddp_device_ids_on_a_cpu_rank_must_be_none_as_in_torch():
    def body():
        with pytest.raises(ConfigError, match="pass device_ids=None"):
            DDP(torch.nn.Linear(2, 2), device_ids=[dist.get_rank()])
        with pytest.raises(ConfigError, match="does not implement mixed_precision"):
            DDP(torch.nn.Linear(2, 2), mixed_precision=object())

    run_ranks(body, 2)


def test_ddp_device_ids_name_the_rank_device_on_a_cuda_rank():
    """torch's rules for a module on one CUDA device (meta tensors stand in: no GPU here)."""
    from threadpar.parallel.ddp.torch_options import resolve_device_ids

    module = torch.nn.Linear(2, 2, device="meta")
    rank_device = torch.device("cuda", 1)
    assert resolve_device_ids(module, [1], None, rank_device) == rank_device
    assert resolve_device_ids(module, [torch.device("cuda", 1)], 1, rank_device) == rank_device
    assert resolve_device_ids(module, None, None, rank_device) is None
    with pytest.raises(ConfigError, match=r"this rank's device is cuda:1; pass device_ids=\[1\]"):
        resolve_device_ids(module, [0], None, rank_device)
    with pytest.raises(ConfigError, match=r"names several devices; .* pass device_ids=\[1\]"):
        resolve_device_ids(module, [0, 1], None, rank_device)
    with pytest.raises(ConfigError, match="output_device=0 is not device_ids"):
        resolve_device_ids(module, [1], 0, rank_device)


def test_ddp_positional_torch_arguments_and_init_sync():
    def body():
        rank = dist.get_rank()
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(float(rank + 1))
        # torch's order: module, device_ids, output_device, dim, broadcast_buffers, init_sync
        ddp = DDP(model, None, None, 0, True, False)
        assert model.weight[0, 0].item() == rank + 1  # init_sync=False: no copy of rank 0's parameters
        ddp(torch.ones(1, 2)).sum().backward()
        torch.testing.assert_close(model.weight.grad, torch.ones(1, 2))  # the average of equal gradients
        synced = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            synced.weight.fill_(float(rank + 1))
        DDP(synced)  # init_sync=True (torch's default): rank 0's parameters everywhere
        assert synced.weight[0, 0].item() == 1.0

    run_ranks(body, 2)


# across processes (the hierarchical backend, processes simulated in this interpreter) -------------------------
def test_bitwise_ops_and_object_collectives_across_processes():
    from threadpar.testing import run_processes

    per_process = run_processes(lambda: (_bitwise_workload(), _object_workload()), 2, 2)
    results = [r for outcomes in per_process for r in outcomes]
    _check_bitwise([bits for bits, _ in results], 4)
    _check_objects([objects for _, objects in results], 4)


def test_a_barrier_timeout_across_processes_names_the_missing_rank():
    from threadpar.testing import launch_processes

    wait = lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=0.5))  # noqa: E731
    outcomes = launch_processes(_missing_rank_body(wait), 2, 2)  # rank 2 is in process 1
    # Every process names rank 2 (process 1 from its own members, process 0 by asking process 1), whichever
    # times out first (both after the barrier's 0.5 s, not the launch's timeout).
    assert all(isinstance(o, dist.RankFailedError) and "after 0.5 s" in str(o) for o in outcomes), outcomes
    assert all(
        "ranks [2] did not arrive" in str(o) or "rank 2 (process 1) did not arrive" in str(o)
        for o in outcomes
    ), outcomes
