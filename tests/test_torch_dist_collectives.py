"""torch.distributed's own API on threadpar's rank threads (the `threadpar` c10d backend): every op against
what one thread computes from all ranks' inputs, on the threads backend and on the CUDA/NCCL test double."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host

import threadpar

# torch 2.13 deprecates some of the names tutorials use (all_gather_into_tensor & co): they must still work.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

P = 2


def _threads(body):
    return threadpar.launch(body, world_size=P, devices="cpu", timeout=20)


def _nccl(body):
    return to_host(run_fake_gpus(body, P, FakeCuda(), timeout=20))


RUNNERS = [pytest.param(_threads, id="threads"), pytest.param(_nccl, id="nccl")]


def data(rank: int, shape=(2, 3), dtype=torch.float32, device=None) -> torch.Tensor:
    """Rank `rank`'s input: distinct per rank, reproducible by any thread (made on the host, then on `device`)."""
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(device, dtype)
    return torch.randint(0, 64, shape, generator=g).to(device, dtype)


ALL = [data(r) for r in range(P)]


@pytest.mark.parametrize("run", RUNNERS)
def test_all_reduce_every_op(run):
    ints = [data(r, dtype=torch.int64) for r in range(P)]
    expected = {
        "SUM": ALL[0] + ALL[1],
        "AVG": (ALL[0] + ALL[1]) / 2,
        "PRODUCT": ALL[0] * ALL[1],
        "MIN": torch.minimum(ALL[0], ALL[1]),
        "MAX": torch.maximum(ALL[0], ALL[1]),
        "PREMUL_SUM": 0.5 * ALL[0] + 0.5 * ALL[1],
        "PREMUL_SUM tensor": 0.25 * ALL[0] + 0.25 * ALL[1],
        "BAND": ints[0] & ints[1],
        "BOR": ints[0] | ints[1],
        "BXOR": ints[0] ^ ints[1],
    }

    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        out = {}
        for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
            t = data(r, device=dev)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            out[name] = t
        t = data(r, device=dev)
        # The factor as a float and as a one-element tensor (FSDP2's gradient divide); torch < 2.13 keeps it
        # only in the op's pickled state. A tensor factor is on the device: ProcessGroupNCCL gives NCCL its
        # pointer as an ncclScalarDevice (ProcessGroupNCCL.cpp, unpackPreMulSum).
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        out["PREMUL_SUM"] = t
        t = data(r, device=dev)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.25], device=dev)))
        out["PREMUL_SUM tensor"] = t
        for name in ("BAND", "BOR", "BXOR"):
            t = data(r, dtype=torch.int64, device=dev)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            out[name] = t
        pair = [data(r, device=dev), data(r, (4,), device=dev)]
        dist.all_reduce_coalesced(pair)
        out["coalesced"] = pair
        return out

    for out in run(body):
        for name, want in expected.items():
            torch.testing.assert_close(out[name], want, msg=name)
        torch.testing.assert_close(out["coalesced"][0], ALL[0] + ALL[1])
        torch.testing.assert_close(out["coalesced"][1], data(0, (4,)) + data(1, (4,)))


@pytest.mark.parametrize("run", RUNNERS)
def test_gathers_and_reduce_scatters(run):
    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        out = {}
        lst = [torch.empty(2, 3, device=dev) for _ in range(P)]
        dist.all_gather(lst, data(r, device=dev))
        out["all_gather"] = torch.cat(lst)
        big = torch.empty(2 * P, 3, device=dev)
        dist.all_gather_into_tensor(big, data(r, device=dev))
        out["into_tensor"] = big
        outs = [torch.empty(2 * P, 3, device=dev), torch.empty(P, 2, device=dev)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], data(r, device=dev))
            dist.all_gather_into_tensor(outs[1], data(r, (2,), device=dev))
        cm.wait()
        out["gather_coalesced"] = outs
        rs = torch.empty(1, 3, device=dev)
        dist.reduce_scatter(rs, [data(r, device=dev)[i : i + 1] for i in range(P)])
        out["reduce_scatter"] = rs
        rst = torch.empty(1, 3, device=dev)
        dist.reduce_scatter_tensor(rst, data(r, device=dev), op=dist.ReduceOp.AVG)
        out["reduce_scatter_tensor"] = rst
        rsp = torch.empty(
            1, 3, device=dev
        )  # FSDP2's reduce-scatter of gradients divides with a premul factor
        dist.reduce_scatter_tensor(
            rsp, data(r, device=dev), op=dist._make_nccl_premul_sum(torch.tensor([0.25], device=dev))
        )
        out["reduce_scatter_premul"] = rsp
        rsc = [torch.empty(1, 3, device=dev), torch.empty(1, device=dev)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(rsc[0], data(r, device=dev))
            dist.reduce_scatter_tensor(rsc[1], data(r, (2,), device=dev))
        cm.wait()
        out["reduce_scatter_coalesced"] = rsc
        group = dist.group.WORLD.group_name
        out["funcol_all_gather"] = funcol.wait_tensor(funcol.all_gather_tensor(data(r, device=dev), 0, group))
        out["funcol_reduce_scatter"] = funcol.wait_tensor(
            funcol.reduce_scatter_tensor(data(r, device=dev), "sum", 0, group)
        )
        out["funcol_all_reduce"] = funcol.wait_tensor(funcol.all_reduce(data(r, device=dev), "max", group))
        return out

    total = ALL[0] + ALL[1]
    for r, out in enumerate(run(body)):
        torch.testing.assert_close(out["all_gather"], torch.cat(ALL))
        torch.testing.assert_close(out["into_tensor"], torch.cat(ALL))
        torch.testing.assert_close(out["gather_coalesced"][0], torch.cat(ALL))
        torch.testing.assert_close(out["gather_coalesced"][1], torch.stack([data(0, (2,)), data(1, (2,))]))
        torch.testing.assert_close(out["reduce_scatter"], total[r : r + 1])
        torch.testing.assert_close(out["reduce_scatter_tensor"], total[r : r + 1] / 2)
        torch.testing.assert_close(out["reduce_scatter_premul"], total[r : r + 1] / 4)
        torch.testing.assert_close(out["reduce_scatter_coalesced"][0], total[r : r + 1])
        torch.testing.assert_close(
            out["reduce_scatter_coalesced"][1], (data(0, (2,)) + data(1, (2,)))[r : r + 1]
        )
        torch.testing.assert_close(out["funcol_all_gather"], torch.cat(ALL))
        torch.testing.assert_close(out["funcol_reduce_scatter"], total[r : r + 1])
        torch.testing.assert_close(out["funcol_all_reduce"], torch.maximum(ALL[0], ALL[1]))


@pytest.mark.parametrize("run", RUNNERS)
def test_rooted_ops_and_all_to_all(run):
    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        out = {}
        t = data(r, device=dev)
        dist.broadcast(t, src=1)
        out["broadcast"] = t
        t = data(r, device=dev)
        dist.reduce(t, dst=0)
        out["reduce"] = t
        gl = [torch.empty(2, 3, device=dev) for _ in range(P)] if r == 1 else None
        dist.gather(data(r, device=dev), gl, dst=1)
        out["gather"] = gl
        s = torch.empty(2, 3, device=dev)
        dist.scatter(s, [data(10 + i, device=dev) for i in range(P)] if r == 0 else None, src=0)
        out["scatter"] = s
        outs = [torch.empty(1, 3, device=dev) for _ in range(P)]
        dist.all_to_all(outs, list(data(r, device=dev).split(1)))
        out["all_to_all"] = torch.cat(outs)
        # uneven: rank r sends r+1 rows to each peer
        send = torch.full((P * (r + 1), 2), float(r), device=dev)
        recv = torch.empty(sum(s + 1 for s in range(P)), 2, device=dev)
        dist.all_to_all_single(recv, send, [s + 1 for s in range(P)], [r + 1] * P)
        out["all_to_all_uneven"] = recv
        return out

    for r, out in enumerate(run(body)):
        torch.testing.assert_close(out["broadcast"], ALL[1])
        if r == 0:
            torch.testing.assert_close(out["reduce"], ALL[0] + ALL[1])
        else:
            torch.testing.assert_close(torch.stack(out["gather"]), torch.stack(ALL))
        torch.testing.assert_close(out["scatter"], data(10 + r))
        torch.testing.assert_close(out["all_to_all"], torch.cat([ALL[s][r : r + 1] for s in range(P)]))
        expected = torch.cat([torch.full((s + 1, 2), float(s)) for s in range(P)])
        torch.testing.assert_close(out["all_to_all_uneven"], expected)


@pytest.mark.parametrize("run", RUNNERS)
def test_the_group_is_its_own_backend_for_the_devices_it_serves(run):
    # torch.distributed reads a group's capabilities from `group._get_backend(device)`; from torch 2.14,
    # batch_isend_irecv does so for every ProcessGroup subclass, without catching c10d's RuntimeError.
    def body():
        group = dist.group.WORLD
        backend = group._get_backend(threadpar.get_device())
        capabilities = [
            getattr(backend, name, None) for name in ("supports_coalescing", "supports_splitting")
        ]
        with pytest.raises(RuntimeError, match="No backend type associated with device type meta"):
            group._get_backend(torch.device("meta"))  # as c10d's ProcessGroup::getBackend raises
        return backend is group, capabilities, dist.distributed_c10d._get_process_group_uid(group)

    assert run(body) == [(True, [False, False], -1)] * P


@pytest.mark.parametrize("run", RUNNERS)
def test_point_to_point_and_barrier(run):
    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        out = {}
        if r == 0:
            dist.send(data(0, device=dev), dst=1, tag=3)
            work = dist.isend(data(5, device=dev), dst=1)
            work.wait()
            dist.send(data(6, device=dev), dst=1, tag=9)
        else:
            t = torch.empty(2, 3, device=dev)
            dist.recv(t, src=0, tag=3)
            out["recv"] = t
            t2 = torch.empty(2, 3, device=dev)
            dist.irecv(t2, src=0).wait()
            out["irecv"] = t2
            t3 = torch.empty(2, 3, device=dev)
            out["source"] = dist.recv(t3, tag=9)  # from any source
            out["any"] = t3
        ops = [
            dist.P2POp(dist.isend, data(20 + r, device=dev), 1 - r),
            dist.P2POp(dist.irecv, torch.empty(2, 3, device=dev), 1 - r),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["batch"] = ops[1].tensor
        # Receives match a peer's messages in the order they were posted, whichever is waited on first.
        if r == 0:
            dist.send(data(30, device=dev), dst=1)
            dist.send(data(31, device=dev), dst=1)
        else:
            first, second = torch.empty(2, 3, device=dev), torch.empty(2, 3, device=dev)
            w1, w2 = dist.irecv(first, src=0), dist.irecv(second, src=0)
            w2.wait()
            w1.wait()
            out["posted_order"] = (first, second)
        dist.barrier()
        return out

    out0, out1 = run(body)
    torch.testing.assert_close(out1["posted_order"][0], data(30))
    torch.testing.assert_close(out1["posted_order"][1], data(31))
    torch.testing.assert_close(out1["recv"], data(0))
    torch.testing.assert_close(out1["irecv"], data(5))
    torch.testing.assert_close(out1["any"], data(6))
    assert out1["source"] == 0
    torch.testing.assert_close(out0["batch"], data(21))
    torch.testing.assert_close(out1["batch"], data(20))


@pytest.mark.parametrize("run", RUNNERS)
def test_work_wait_future_and_completion(run):
    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        t = data(r, device=dev)
        work = dist.all_reduce(t, async_op=True)
        future = work.get_future()
        work.wait()
        assert work.is_completed()
        (value,) = future.wait()
        return t, value, type(dist.group.WORLD.threadpar_group._backend).__name__

    results = run(body)
    assert {backend for *_, backend in results} == {"NcclGroup" if run is _nccl else "ThreadsGroup"}
    for t, value, _ in results:
        torch.testing.assert_close(t, ALL[0] + ALL[1])
        torch.testing.assert_close(value, ALL[0] + ALL[1])


def test_object_collectives():
    def body():
        r = dist.get_rank()
        gathered = [None] * P
        dist.all_gather_object(gathered, {"rank": r, "name": f"r{r}"})
        objs = ["hello", {"x": 1}] if r == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)
        into = [None] * P if r == 1 else None
        dist.gather_object(("from", r), into, dst=1)
        got = [None]
        dist.scatter_object_list(got, [f"to{i}" for i in range(P)] if r == 0 else None, src=0)
        return gathered, objs, into, got[0]

    results = _threads(body)
    for r, (gathered, objs, into, got) in enumerate(results):
        assert gathered == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
        assert objs == ["hello", {"x": 1}]
        assert into == ([("from", 0), ("from", 1)] if r == 1 else None)
        assert got == f"to{r}"


def test_new_group_shares_threadpar_groups():
    """A torch group and threadpar's group of the same ranks are one group: calls from both APIs interleave
    in one order on one set of communicators."""

    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        sub = dist.new_group([0, 1, 2])
        t = torch.tensor([float(r)], device=dev)
        if r < 3:
            dist.all_reduce(t, group=sub)
            assert sub.threadpar_group is threadpar.new_group([0, 1, 2])
            u = torch.tensor([1.0], device=dev)
            threadpar.all_reduce(u, group=sub.threadpar_group)
            return t.item(), u.item(), dist.get_rank(sub), dist.get_process_group_ranks(sub)
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
        return None

    results = threadpar.launch(body, world_size=4, devices="cpu", timeout=20)
    for r in range(3):
        assert results[r] == (3.0, 3.0, r, [0, 1, 2])
    assert results[3] is None


def test_nccl_wait_orders_the_callers_stream_and_keeps_tensors_alive():
    """c10d's contract on CUDA: Work.wait() makes the caller's current stream wait for the collective (the
    host does not wait for the device, nor for the peers), and the tensors are protected until the comm
    stream is done."""
    fake = FakeCuda()
    late = threading.Event()

    def body():
        dev = threadpar.get_device()
        mine = fake.current_stream(dev)
        dist.all_reduce(torch.ones(1, device=dev))  # the communicators exist from here on
        t = torch.ones(3, device=dev)
        if dist.get_rank() == 1:
            assert late.wait(30)  # rank 1's part comes once rank 0 checked what follows
        work = dist.all_reduce(t, async_op=True)
        if dist.get_rank() == 1:
            work.wait()
            return None
        before = fake.mark(mine, "before wait")
        assert not work.is_completed()
        work.wait()  # returns at once: only the stream waits
        after = fake.mark(mine, "after wait")
        call = fake.calls_of("all_reduce", 0)[-1]
        protected = any(x.data_ptr() == t.data_ptr() and s is call.stream for x, s in fake.recorded)
        late.set()
        return fake.ordered(call.node, before), fake.ordered(call.node, after), protected, t

    before, after, protected, t = run_fake_gpus(body, P, fake, timeout=20)[0]
    assert (before, after, protected) == (False, True, True)
    torch.testing.assert_close(t.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("run", RUNNERS)
def test_all_to_all_single_takes_split_sizes_as_tensors(run):
    # torch's threaded PG and gloo accept tensor split sizes (torch.distributed.all_to_all_single documents
    # them as lists; MoE code computes them as tensors): output_split_sizes=torch.tensor([...]).
    def body():
        dev = threadpar.get_device()
        r = dist.get_rank()
        sends = (
            torch.arange(3.0, device=dev) + 10 * r
        )  # rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 likewise
        out = torch.empty(2 if r == 0 else 4, device=dev)
        dist.all_to_all_single(
            out, sends, output_split_sizes=torch.tensor([1, 1] if r == 0 else [2, 2], device=dev),
            input_split_sizes=torch.tensor([1, 2], device=dev),
        )  # fmt: skip
        return out

    first, second = run(body)
    torch.testing.assert_close(first, torch.tensor([0.0, 10.0]))
    torch.testing.assert_close(second, torch.tensor([1.0, 2.0, 11.0, 12.0]))


@pytest.mark.parametrize("run", RUNNERS)
def test_all_reduce_of_a_leaf_that_requires_grad(run):
    # gloo and torch's threaded PG write below autograd; an in-place write through torch ops would raise
    # "a leaf Variable that requires grad is being used in an in-place operation".
    def body():
        dev = threadpar.get_device()
        w = torch.full((3,), float(dist.get_rank() + 1), requires_grad=True, device=dev)
        dist.all_reduce(w)
        threadpar.all_reduce(w)
        dist.broadcast(w, src=1)
        return w.detach(), w.requires_grad, w.is_leaf

    for w, requires_grad, leaf in run(body):
        torch.testing.assert_close(w, torch.full((3,), 6.0))
        assert requires_grad and leaf
