"""Every collective of the `threads` backend against results computed directly with torch.

Each rank builds its inputs from (rank, case) with its own generator, so the test can rebuild every
rank's inputs outside the launch and compute the expected outputs in float64. Both algorithms run: the
one-thread path for small messages and the split path for large ones (forced with the size threshold).
"""

import functools
import itertools

import pytest
import torch

import threadpar
import threadpar.comm.threads.group as threads_backend
from threadpar import ReduceOp
from threadpar.testing import run_ranks

WORLD_SIZES = [1, 2, 3, 4, 8]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
SHAPES = [(), (0,), (5,), (3, 7), (2, 3, 4)]  # 0-d, empty, and shapes that don't divide by P


@pytest.fixture(params=["one_thread", "split"])
def algorithm(request, monkeypatch):
    monkeypatch.setattr(threads_backend, "SMALL_BYTES", 1 << 40 if request.param == "one_thread" else -1)
    return request.param


def make_input(rank, case, shape, dtype):
    g = torch.Generator().manual_seed(1000 * rank + case)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    low = 0 if dtype == torch.uint8 else -4
    return torch.randint(low, 5, shape, generator=g, dtype=torch.int64).to(dtype)


BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}
BITWISE_DTYPES = [torch.int64, torch.int32, torch.uint8]


def dtypes_for(op):
    if op in BITWISE:
        return BITWISE_DTYPES
    return DTYPES if op is not ReduceOp.PRODUCT else [torch.float64, torch.int64]


def reference(inputs, op):
    if op in BITWISE:
        return functools.reduce(BITWISE[op], inputs)
    x = torch.stack([t.to(torch.float64) for t in inputs])
    if op is ReduceOp.SUM:
        return x.sum(0)
    if op is ReduceOp.AVG:
        return x.mean(0) if inputs[0].dtype.is_floating_point else torch.trunc(x.sum(0) / len(inputs))
    if op is ReduceOp.PRODUCT:
        return x.prod(0)
    return x.min(0).values if op is ReduceOp.MIN else x.max(0).values


def close(actual, expected, *, n_terms=1):
    """Exact for integers; for floats a tolerance that grows with the dtype's epsilon and the terms summed."""
    expected = expected.to(actual.dtype) if not actual.dtype.is_floating_point else expected
    if actual.dtype.is_floating_point:
        eps = torch.finfo(actual.dtype).eps
        tol = 4 * eps * n_terms
        torch.testing.assert_close(
            actual.to(torch.float64), expected.to(torch.float64), rtol=tol, atol=tol * 4
        )
    else:
        torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=0, atol=0)


def cases(dtypes=DTYPES, shapes=SHAPES):
    return list(enumerate(itertools.product(dtypes, shapes)))


def group_choices(world_size):
    """World, and for 4 or 8 ranks also TP and DP sub-groups (layout tp=2)."""
    if world_size >= 4:
        return dict(tp=2), [None, "TP", "DP"]
    return {}, [None]


def members(world_size, layout_kwargs, group, rank):
    layout = threadpar.Layout.build(world_size, **layout_kwargs)
    return list(range(world_size)) if group is None else layout.group_ranks(group, rank)


# (bitwise ops on 1 to 4 ranks: test_torch_api.py; here both algorithms on 3 and 8)
@pytest.mark.parametrize(
    "op, world_size", [(op, w) for op in ReduceOp for w in WORLD_SIZES if op not in BITWISE or w in (3, 8)]
)
def test_all_reduce(world_size, op, algorithm):
    layout_kwargs, groups = group_choices(world_size)
    dtypes = dtypes_for(op)

    def body():
        rank, out = threadpar.get_rank(), {}
        for group in groups:
            for case, (dtype, shape) in cases(dtypes):
                t = make_input(rank, case, shape, dtype)
                threadpar.all_reduce(t, op=op, group=group)
                out[group, case] = t
        return out

    results = run_ranks(body, world_size, **layout_kwargs)
    for rank, out in enumerate(results):
        for (group, case), actual in out.items():
            dtype, shape = cases(dtypes)[case][1]
            peers = members(world_size, layout_kwargs, group, rank)
            expected = reference([make_input(p, case, shape, dtype) for p in peers], op)
            close(actual, expected, n_terms=len(peers))
            # every member holds bit-identical results
            assert torch.equal(actual, results[peers[0]][group, case])


def test_all_reduce_accepts_torch_distributed_ops_and_noncontiguous_tensors():
    import torch.distributed as dist

    def body():
        base = torch.arange(12.0).reshape(3, 4) * (threadpar.get_rank() + 1)
        view = base.t()  # not contiguous
        threadpar.all_reduce(view, op=dist.ReduceOp.MAX)
        return base

    for base in run_ranks(body, 2):
        torch.testing.assert_close(base, torch.arange(12.0).reshape(3, 4) * 2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_reduce_scatter_gather(world_size, algorithm):
    layout_kwargs, groups = group_choices(world_size)

    def body():
        rank, out = threadpar.get_rank(), {}
        for group in groups:
            peers = members(world_size, layout_kwargs, group, rank)
            root = peers[-1]
            for case, (dtype, shape) in cases():
                t = make_input(rank, case, shape, dtype)
                threadpar.broadcast(t, src=root, group=group)
                out["broadcast", group, case] = t

                t = make_input(rank, case, shape, dtype)
                threadpar.reduce(t, dst=root, op=ReduceOp.SUM, group=group)
                if rank == root:
                    out["reduce", group, case] = t

                chunks = [make_input(rank, 100 + case + i, shape, dtype) for i in range(len(peers))]
                t = torch.empty(shape, dtype=dtype)
                threadpar.scatter(t, chunks if rank == root else None, src=root, group=group)
                out["scatter", group, case] = t

                outs = [torch.empty(shape, dtype=dtype) for _ in peers] if rank == root else None
                threadpar.gather(make_input(rank, case, shape, dtype), outs, dst=root, group=group)
                if rank == root:
                    out["gather", group, case] = outs
        return out

    results = run_ranks(body, world_size, **layout_kwargs)
    for rank, out in enumerate(results):
        for (kind, group, case), actual in out.items():
            dtype, shape = cases()[case][1]
            peers = members(world_size, layout_kwargs, group, rank)
            root, me = peers[-1], peers.index(rank)
            if kind == "broadcast":
                assert torch.equal(actual, make_input(root, case, shape, dtype))
            elif kind == "reduce":
                close(
                    actual,
                    reference([make_input(p, case, shape, dtype) for p in peers], ReduceOp.SUM),
                    n_terms=len(peers),
                )
            elif kind == "scatter":
                assert torch.equal(actual, make_input(root, 100 + case + me, shape, dtype))
            else:
                for p, got in zip(peers, actual):
                    assert torch.equal(got, make_input(p, case, shape, dtype))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_and_reduce_scatter(world_size, algorithm):
    layout_kwargs, groups = group_choices(world_size)
    shapes = [(), (5,), (3, 7)]

    def body():
        rank, out = threadpar.get_rank(), {}
        for group in groups:
            n = len(members(world_size, layout_kwargs, group, rank))
            for case, (dtype, shape) in cases(shapes=shapes):
                x = make_input(rank, case, shape, dtype)
                lst = [torch.empty(shape, dtype=dtype) for _ in range(n)]
                threadpar.all_gather(lst, x, group=group)
                out["all_gather", group, case] = torch.stack(lst)

                flat = torch.empty((n, *shape), dtype=dtype)
                threadpar.all_gather_into_tensor(flat, x, group=group)
                out["all_gather_into_tensor", group, case] = flat

                chunks = [make_input(rank, 200 + case + i, shape, dtype) for i in range(n)]
                y = torch.empty(shape, dtype=dtype)
                threadpar.reduce_scatter(y, chunks, op=ReduceOp.SUM, group=group)
                out["reduce_scatter", group, case] = y

                y2 = torch.empty(shape, dtype=dtype)
                threadpar.reduce_scatter_tensor(y2, torch.stack(chunks), op=ReduceOp.MAX, group=group)
                out["reduce_scatter_tensor", group, case] = y2
        return out

    results = run_ranks(body, world_size, **layout_kwargs)
    for rank, out in enumerate(results):
        for (kind, group, case), actual in out.items():
            dtype, shape = cases(shapes=shapes)[case][1]
            peers = members(world_size, layout_kwargs, group, rank)
            me = peers.index(rank)
            if kind.startswith("all_gather"):
                assert torch.equal(actual, torch.stack([make_input(p, case, shape, dtype) for p in peers]))
            else:
                op = ReduceOp.SUM if kind == "reduce_scatter" else ReduceOp.MAX
                inputs = [make_input(p, 200 + case + me, shape, dtype) for p in peers]
                close(actual, reference(inputs, op), n_terms=len(peers))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_with_uneven_splits(world_size, algorithm):
    def body():
        rank = threadpar.get_rank()
        # rank r sends (r + d + 1) rows to rank d
        sends = [torch.full((rank + d + 1, 2), float(10 * rank + d)) for d in range(world_size)]
        recvs = [torch.empty((s + rank + 1, 2)) for s in range(world_size)]
        threadpar.all_to_all(recvs, sends)

        inp = torch.cat(sends)
        out = torch.empty((sum(s + rank + 1 for s in range(world_size)), 2))
        threadpar.all_to_all_single(
            out, inp, [s + rank + 1 for s in range(world_size)], [rank + d + 1 for d in range(world_size)]
        )
        even_in = torch.arange(world_size * 3, dtype=torch.int64) + 100 * rank
        even_out = torch.empty_like(even_in)
        threadpar.all_to_all_single(even_out, even_in)
        return recvs, out, even_out

    for rank, (recvs, out, even_out) in enumerate(run_ranks(body, world_size)):
        for s, got in enumerate(recvs):
            assert torch.equal(got, torch.full((s + rank + 1, 2), float(10 * s + rank)))
        assert torch.equal(out, torch.cat(recvs))
        expected = torch.cat([torch.arange(rank * 3, rank * 3 + 3) + 100 * s for s in range(world_size)])
        assert torch.equal(even_out, expected)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_coalesced_all_reduce_and_barrier(world_size, algorithm):
    def body():
        rank = threadpar.get_rank()
        tensors = [torch.full((n,), float(rank + 1)) for n in (1, 0, 7, 130)]
        threadpar.all_reduce_coalesced(tensors, op=ReduceOp.AVG)
        threadpar.barrier()
        return tensors

    mean = sum(range(1, world_size + 1)) / world_size
    for tensors in run_ranks(body, world_size):
        for t, n in zip(tensors, (1, 0, 7, 130)):
            torch.testing.assert_close(t, torch.full((n,), mean))


def test_integer_avg_truncates_like_nccl():
    def body():
        t = torch.tensor([threadpar.get_rank() * 3 - 4], dtype=torch.int64)  # -4, -1, 2
        threadpar.all_reduce(t, op="avg")
        return t.item()

    assert run_ranks(body, 3) == [-1, -1, -1]  # trunc(-3 / 3)


def test_new_group_same_ranks_same_group_and_non_members():
    def body():
        rank = threadpar.get_rank()
        g = threadpar.new_group([1, 3], group_desc="odd")
        assert threadpar.new_group([1, 3]) is g
        assert threadpar.comm.new_group([3, 1]) is g  # sorted, as torch's new_group does
        assert threadpar.new_group([3, 1], sort_ranks=False) is not g  # order matters: a different group
        if rank in (1, 3):
            assert g.rank() == [1, 3].index(rank) and g.size() == 2
            t = torch.tensor([float(rank)])
            g.all_reduce(t)
            return t.item()
        assert g.rank() == -1
        with pytest.raises(threadpar.ConfigError, match="not a member of group 'odd'"):
            g.all_reduce(torch.zeros(1))
        return None

    assert run_ranks(body, 4) == [None, 4.0, None, 4.0]


def test_layout_groups_are_named_like_infinitrain():
    def body():
        names = {axis: threadpar.get_group(axis).name for axis in ("DP", "TP", "PP")}
        assert threadpar.get_group(threadpar.Axis.TP) is threadpar.get_group("TP")
        assert threadpar.get_group(names["TP"]) is threadpar.get_group("TP")
        return names

    names = run_ranks(body, 8, tp=2, pp=2)
    assert names[0] == {"DP": "DP0", "TP": "TP0", "PP": "PP0"}
    assert names[7] == {"DP": "DP3", "TP": "TP3", "PP": "PP3"}
