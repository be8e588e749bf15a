"""The nccl backend on the CUDA/NCCL test double: results vs the `threads` backend, and how it drives NCCL.

Results: one workload (every collective, every dtype and ReduceOp the threads backend supports, on the
world and on TP/DP sub-groups, plus point to point) runs on the threads backend (the oracle) and on the nccl
backend over the double; the outputs must agree. Mechanics: each member's own call on its own
communicator, from its own thread, on its current stream (synchronous) or its comm stream (asynchronous);
point to point on pairs' communicators; scatter, gather, all_to_all as grouped sends and receives.
"""

import threading

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host

import threadpar
from threadpar import ReduceOp
from threadpar.comm.common.reduce_op import check_reducible
from threadpar.errors import ConfigError
from threadpar.testing import run_ranks

# Each test runs with the double running NCCL operations once issued and lazily (conftest.fake_mode).
pytestmark = pytest.mark.usefixtures("fake_mode")

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]  # fmt: skip


def make(rank: int, key: int, shape, dtype) -> torch.Tensor:
    """A tensor of random values on this rank's device (made on the host, the same on every backend)."""
    g = torch.Generator().manual_seed(7919 * rank + key)
    if dtype == torch.bool:
        made = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        made = torch.randn(shape, generator=g, dtype=wide).to(dtype)
    else:
        made = torch.randint(0 if dtype == torch.uint8 else -3, 4, shape, generator=g).to(dtype)
    return made.to(threadpar.get_device())


def valid_ops(dtype, ops=tuple(ReduceOp)):
    valid = []
    for op in ops:
        try:
            check_reducible(dtype, op)
        except ConfigError:
            continue
        if not (dtype == torch.bool and op is ReduceOp.AVG):  # bool has no average on either backend
            valid.append(op)
    return valid


def workload(groups, dtypes=DTYPES, shapes=((3, 4),), ops=tuple(ReduceOp), p2p=True):
    """Every collective (and point to point: `p2p`); returns {key: output} for comparison between backends."""
    rank, out, key, dev = threadpar.get_rank(), {}, 0, threadpar.get_device()
    for group in groups:
        g = threadpar.get_group(group)
        n, root = g.size(), g.ranks[-1]
        for dtype in dtypes:
            for shape in shapes:
                key += 1
                tag = (str(group), str(dtype), shape)
                x = make(rank, key, shape, dtype)
                for op in valid_ops(dtype, ops):
                    t = x.clone()
                    threadpar.all_reduce(t, op=op, group=group)
                    out[("all_reduce", op, *tag)] = t
                    t = x.clone()
                    threadpar.reduce(t, dst=root, op=op, group=group)
                    out[("reduce", op, *tag)] = t
                    parts = [make(rank, key + 100 + i, shape, dtype) for i in range(n)]
                    y = torch.empty(shape, dtype=dtype, device=dev)
                    threadpar.reduce_scatter(y, parts, op=op, group=group)
                    out[("reduce_scatter", op, *tag)] = y
                    y = torch.empty(shape, dtype=dtype, device=dev)
                    threadpar.reduce_scatter_tensor(y, torch.stack(parts), op=op, group=group)
                    out[("reduce_scatter_tensor", op, *tag)] = y
                pair = [x.clone(), make(rank, key + 50, (5,), dtype)]
                threadpar.all_reduce_coalesced(pair, group=group)
                out[("coalesced", *tag)] = pair
                t = x.clone()
                threadpar.broadcast(t, src=root, group=group)
                out[("broadcast", *tag)] = t
                lst = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(n)]
                threadpar.all_gather(lst, x, group=group)
                out[("all_gather", *tag)] = lst
                whole = torch.empty((n, *shape), dtype=dtype, device=dev)
                threadpar.all_gather_into_tensor(whole, x, group=group)
                out[("all_gather_into_tensor", *tag)] = whole
                y = torch.empty(shape, dtype=dtype, device=dev)
                chunks = [make(rank, key + 200 + i, shape, dtype) for i in range(n)]
                threadpar.scatter(y, chunks if rank == root else None, src=root, group=group)
                out[("scatter", *tag)] = y
                outs = (
                    [torch.empty(shape, dtype=dtype, device=dev) for _ in range(n)] if rank == root else None
                )
                threadpar.gather(x, outs, dst=root, group=group)
                out[("gather", *tag)] = outs
        sends = [torch.full((g.rank() + d + 1, 2), 10.0 * rank + d, device=dev) for d in range(n)]
        recvs = [torch.empty((s + g.rank() + 1, 2), device=dev) for s in range(n)]
        threadpar.all_to_all(recvs, sends, group=group)
        out["all_to_all", str(group)] = recvs
        threadpar.barrier(group=group)
    noncontiguous = (torch.arange(12.0, device=dev).reshape(3, 4) * (rank + 1)).t()
    threadpar.all_reduce(noncontiguous, op="MAX")
    out["noncontiguous"] = noncontiguous
    if not p2p:
        return out
    world = threadpar.get_world_size()
    threadpar.send(torch.arange(3.0, device=dev) + rank, dst=(rank + 1) % world, tag=rank)
    got = torch.empty(3, device=dev)
    src = threadpar.recv(got, src=(rank - 1) % world, tag=(rank - 1) % world)
    out["p2p"] = (src, got)
    return out


def assert_same(actual, expected, where):
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for a, e in zip(actual, expected):
            assert_same(a, e, where)
    elif isinstance(expected, torch.Tensor):
        exact = not (expected.dtype.is_floating_point or expected.dtype.is_complex)
        tol = {} if not exact else {"rtol": 0, "atol": 0}
        if expected.dtype in (torch.float16, torch.bfloat16):
            tol = {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{where}: {m}")
    else:
        assert actual == expected, where


def compare(fake, world_size, *args, **layout):
    expected = run_ranks(workload, world_size, *args, **layout)
    actual = to_host(run_fake_gpus(lambda: workload(*args), world_size, fake, **layout))
    for rank in range(world_size):
        assert actual[rank].keys() == expected[rank].keys()
        for key in expected[rank]:
            assert_same(actual[rank][key], expected[rank][key], f"rank {rank} {key}")


def test_every_collective_dtype_and_op_matches_the_threads_backend():
    compare(FakeCuda(), 4, [None, "TP"], tp=2)


def test_scalars_and_empty_tensors_match_the_threads_backend():
    compare(FakeCuda(), 3, [None], [torch.float32, torch.int16, torch.complex64, torch.bool], [(), (0,)])


@pytest.mark.parametrize(
    "nccl_version", [(2, 21, 5), (2, 10, 3), (2, 8, 4)], ids=["ncclAvg", "no-premulsum", "sum-then-divide"]
)
def test_avg_uses_ncclavg_only_where_nccl_has_it(nccl_version):
    fake = FakeCuda(nccl_version)
    dtypes = [torch.float32, torch.bfloat16, torch.complex128, torch.int32, torch.uint8]
    compare(fake, 3, [None], dtypes, ((2, 3),), (ReduceOp.AVG,), nccl_version >= (2, 14))  # (P2P needs 2.14)
    reduces = fake.calls_named("reduce")  # only the AVG loop issues these
    float_ops = {c.extra["op"] for c in reduces if c.inputs[0].dtype in (torch.float32, torch.float64)}
    half_ops = {c.extra["op"] for c in reduces if c.inputs[0].dtype == torch.bfloat16}
    int_ops = {c.extra["op"] for c in reduces if not c.inputs[0].dtype.is_floating_point}
    assert float_ops == ({4} if nccl_version >= (2, 10) else {0})
    # bfloat16 over 3 ranks: ncclAvg would pre-multiply by a 1/3 rounded to bfloat16 (reduction.exact_avg_scale);
    # from NCCL 2.11 each communicator's own ncclRedOpCreatePreMulSum by 2^-2, before 2.11 SUM (then divide)
    if nccl_version >= (2, 11):
        halves = [c for c in reduces if c.inputs[0].dtype == torch.bfloat16]
        assert halves and min(half_ops) >= 5  # user-created ops (ncclNumOps = 5), one per communicator
        assert {float(c.extra["scalar"]) for c in halves} == {0.25}
        assert len({(c.comm.uid, c.comm.rank) for c in halves}) == len(half_ops)
    else:
        assert half_ops == ({0} if nccl_version >= (2, 10) else set())  # (NCCL < 2.10: gathered, no reduce)
    assert int_ops == {0}  # integers: SUM, then a division that truncates like the threads backend


def test_each_member_issues_its_own_call_on_its_own_communicator_and_current_stream():
    fake = FakeCuda()

    def body():
        rank, device = threadpar.get_rank(), threadpar.get_device()
        mine = fake.current_stream(device)
        t = torch.full((4,), float(rank), device=device)
        produced = fake.mark(mine, "produce")
        threadpar.all_reduce(t, group="TP")  # the group's first: creates the communicators
        threadpar.all_reduce(t, group="TP")  # issued by the rank thread itself
        consumed = fake.mark(mine, "consume")
        return t.cpu(), mine, produced, consumed

    results = run_fake_gpus(body, 4, fake, tp=2)
    calls = fake.calls_named("all_reduce")
    assert len(calls) == 8  # two collectives on each TP group, one call per member each: no leader
    for r, (t, mine, produced, consumed) in enumerate(results):
        torch.testing.assert_close(t, torch.full((4,), 2.0 * (2 * (r // 2) + 0.5) * 2))
        first, second = [c for c in calls if c.stream is mine]  # synchronous: on the caller's current stream
        assert "threadpar-nccl-connect" in first.thread  # made with the communicator, on a connector
        assert second.thread == f"threadpar-rank-{r}"  # then the rank thread calls NCCL itself
        assert first.comm == second.comm and first.comm.rank == r % 2
        assert fake.ordered(produced, first.node) and fake.ordered(second.node, consumed)
        assert not fake.recorded or all(s is not mine for _, s in fake.recorded)  # no events, no records
    assert len({c.comm.uid for c in calls}) == 2  # two cliques (TP0, TP1), one communicator per member
    assert len(fake.nccl.init_calls) == 4
    assert not fake.nccl.violations


def test_an_async_op_returns_at_once_and_its_stream_waits_for_the_late_peer():
    fake = FakeCuda()
    late = threading.Event()

    def body():
        device = threadpar.get_device()
        mine = fake.current_stream(device)
        threadpar.all_reduce(torch.ones(1, device=device))  # the communicators exist from here on
        t = torch.ones(3, device=device)
        if threadpar.get_rank() == 1:
            assert late.wait(30)  # rank 1 issues its part only once rank 0 has checked everything below
        work = threadpar.all_reduce(t, async_op=True)
        if threadpar.get_rank() == 1:
            work.wait()
            return t
        before = fake.mark(mine, "before wait")
        assert not work.is_completed()  # issued, but rank 1's part is not: the device waits, not the host
        assert work.wait() is True  # returns at once: only the stream waits
        after = fake.mark(mine, "after wait")
        with pytest.raises(
            threadpar.CollectiveTimeoutError, match=r"timed out after 0\.2 s waiting for the device"
        ):
            work.wait(timeout=0.2)
        # (rank 0's own: rank 1's first all_reduce, issued by its connector, may be logged after this one)
        node = fake.calls_of("all_reduce", rank=0)[-1].node
        assert (fake.ordered(node, before), fake.ordered(node, after)) == (False, True)
        late.set()
        work.wait(timeout=5)
        assert work.is_completed() and work.is_success()
        return t

    for t in to_host(run_fake_gpus(body, 2, fake)):
        torch.testing.assert_close(t, torch.full((3,), 2.0))


def test_send_and_recv_are_nccl_calls_on_the_pairs_own_communicators_and_streams():
    fake = FakeCuda()

    def body():
        rank, device = threadpar.get_rank(), threadpar.get_device()
        mine = fake.current_stream(device)
        if rank == 0:
            t = torch.arange(4.0, device=device)
            produced = fake.mark(mine, "produce")
            threadpar.send(t, dst=1)
            t.mul_(10)  # send returned: the stream may write t again (the message is a snapshot)
            work = threadpar.isend(t, dst=1, tag=1)
            return produced, work
        got = torch.empty(4, device=device)
        threadpar.recv(got, src=0)
        consumed = fake.mark(mine, "consume")
        return got.cpu(), consumed, threadpar.get_group().recv_tensor(src=0, tag=1).cpu()

    (produced, work), (got, consumed, second) = run_fake_gpus(body, 2, fake)
    sends = [
        c for c in fake.calls_named("send") if c.inputs[0].numel > 1
    ]  # (not the pairs' connecting bytes)
    recvs = [c for c in fake.calls_named("recv") if c.outputs[0].numel > 1]
    assert len(sends) == 2 and len(recvs) == 2
    assert sends[0].stream is sends[1].stream and sends[0].stream in fake.comm_streams
    assert recvs[0].stream is recvs[1].stream and recvs[0].stream is not sends[0].stream
    assert sends[0].comm.uid == recvs[0].comm.uid  # rank 0 -> 1 has a communicator of its own
    assert fake.ordered(produced, sends[0].node) and fake.ordered(recvs[0].node, consumed)
    assert isinstance(work, threadpar.Work)
    torch.testing.assert_close(got, torch.arange(4.0))
    torch.testing.assert_close(second, torch.arange(4.0) * 10)
    assert not fake.nccl.violations


def test_scatter_gather_all_to_all_are_grouped_sends_and_receives_on_the_groups_communicators():
    fake = FakeCuda()

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        t = torch.empty(2, device=dev)
        chunks = [torch.full((2,), float(i), device=dev) for i in range(3)]
        threadpar.scatter(t, chunks if rank == 2 else None, src=2)
        return t

    assert [t[0].item() for t in run_fake_gpus(body, 3, fake)] == [0.0, 1.0, 2.0]
    names = sorted(c.name for c in fake.calls)
    assert names == ["recv", "recv", "send+send"]  # the root's two sends in one group; its own chunk copied
    assert len({c.comm.uid for c in fake.calls}) == 1  # the group's own communicators


def test_sub_groups_get_their_own_cliques_and_later_launches_reuse_them():
    fake = FakeCuda()

    def body():
        for group in (None, "TP", "DP"):
            threadpar.all_reduce(torch.ones(2, device=threadpar.get_device()), group=group)

    run_fake_gpus(body, 4, fake, tp=2)
    first = {c.comm.uid for c in fake.calls}
    assert len(first) == 5 and len(fake.nccl.init_calls) == 12  # WORLD, TP0, TP1, DP0, DP1
    run_fake_gpus(body, 4, fake, tp=2)  # the first launch's end pooled its cliques
    assert len(fake.nccl.init_calls) == 12  # no new communicators
    assert {c.comm.uid for c in fake.calls[12:]} == first
    assert not fake.nccl.destroyed and not fake.nccl.aborted


def test_tensors_must_be_on_the_ranks_device():
    def body():
        with pytest.raises(ConfigError, match=r"rank \d runs on simgpu:\d but passed a tensor on cpu"):
            threadpar.all_reduce(torch.empty(3))  # (a host tensor: NCCL takes device memory only)

    run_fake_gpus(body, 2, FakeCuda(), timeout=1.0)
