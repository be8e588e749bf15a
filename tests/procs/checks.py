"""Checks that run inside rank threads of a job that spans processes (simulated, or under torchrun).

Every rank builds its inputs from (global rank, case), so each rank can rebuild its peers' inputs and
compare what a collective gave it with the result computed directly (in float64). Each rank's buffers are on
its device (threadpar.get_device(): the host on the threads and hierarchical backends, a GPU or the CUDA double's
on nccl); the references are made on the host and compared with copies of the results. A failed check raises
AssertionError on that rank, which stops the launch and names the rank. Each check returns how many
comparisons it made, so a caller can tell that it ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

import threadpar
from threadpar import ReduceOp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared reference helpers
from test_collectives import BITWISE, close, make_input, reference

REDUCE_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.int16,
]  # fmt: skip
COPY_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64]
SHAPES = [(), (0,), (5,), (3, 7)]


def groups_to_check(world_size: int) -> list:
    """World, the layout's DP and TP groups (tp=2), and a group whose member order interleaves processes."""
    odd = threadpar.new_group([world_size - 1, 0, 1], group_desc="interleaved", sort_ranks=False)
    return [None, "DP", "TP", odd]


def _group(spec):
    return threadpar.get_group(spec) if spec is None or isinstance(spec, str) else spec


def _input(rank: int, case: int, shape, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return make_input(rank, case, shape, torch.int64) > 0
    if dtype.is_complex:
        return torch.complex(
            make_input(rank, case, shape, torch.float32), make_input(rank, -case, shape, torch.float32)
        )
    return make_input(rank, case, shape, dtype)


def _on_device(value):
    """`value` (a tensor, or tuples, lists and dicts of them) on the calling rank's device."""
    device = threadpar.get_device()
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def check_reductions(specs) -> int:
    rank, dev, checks = threadpar.get_rank(), threadpar.get_device(), 0
    for spec in specs:
        g = _group(spec)
        if not g.is_member():
            continue
        peers = list(g.ranks)
        for op in ReduceOp:
            dtypes = REDUCE_DTYPES if op is not ReduceOp.PRODUCT else [torch.float64, torch.int64]
            if op in BITWISE:  # gloo's own for int64, the byte gather for int16
                dtypes = [torch.int64, torch.int16]
            for case, (dtype, shape) in enumerate((d, s) for d in dtypes for s in SHAPES):
                t = _on_device(_input(rank, case, shape, dtype))
                g.all_reduce(t, op=op)
                expected = reference([_input(p, case, shape, dtype) for p in peers], op)
                close(t.cpu(), expected, n_terms=len(peers))
                if case % 4 == 2:  # every member holds bit-identical results
                    seen = [torch.empty_like(t) for _ in peers]
                    g.all_gather(seen, t)
                    assert all(torch.equal(s, t) for s in seen), f"members of {g} disagree"
                checks += 1
        # complex sums, coalesced, async, AVG of ints (truncates), reduce and reduce_scatter
        z = _on_device(_input(rank, 7, (4,), torch.complex64))
        g.all_reduce(z)
        close(
            torch.view_as_real(z.cpu()),
            torch.view_as_real(sum(_input(p, 7, (4,), torch.complex64) for p in peers)),
            n_terms=len(peers),
        )
        tensors = [torch.full((n,), float(rank + 1), device=dev) for n in (1, 0, 7, 130)]
        g.all_reduce_coalesced(tensors, op=ReduceOp.AVG, async_op=True).wait()
        for t in tensors:
            got = t.cpu()
            torch.testing.assert_close(got, torch.full_like(got, sum(p + 1 for p in peers) / len(peers)))
        t = torch.tensor([rank * 3 - 4], dtype=torch.int64, device=dev)
        g.all_reduce(t, op="avg")
        assert t.item() == int(sum(p * 3 - 4 for p in peers) / len(peers))
        for case, (dtype, shape) in enumerate((d, s) for d in REDUCE_DTYPES[:4] for s in SHAPES):
            root = peers[case % len(peers)]
            t = _on_device(_input(rank, case, shape, dtype))
            g.reduce(t, dst=root, op=ReduceOp.SUM)
            mine = _input(rank, case, shape, dtype)
            if rank == root:
                close(
                    t.cpu(),
                    reference([_input(p, case, shape, dtype) for p in peers], ReduceOp.SUM),
                    n_terms=len(peers),
                )
            else:
                assert torch.equal(t.cpu(), mine), "reduce changed a non-destination tensor"
            me, n = peers.index(rank), len(peers)
            chunks = [_on_device(_input(rank, 200 + case + i, shape, dtype)) for i in range(n)]
            y = torch.empty(shape, dtype=dtype, device=dev)
            g.reduce_scatter(y, chunks, op=ReduceOp.SUM)
            close(
                y.cpu(),
                reference([_input(p, 200 + case + me, shape, dtype) for p in peers], ReduceOp.SUM),
                n_terms=n,
            )
            y2 = torch.empty(shape, dtype=dtype, device=dev)
            g.reduce_scatter_tensor(y2, torch.stack(chunks), op=ReduceOp.MAX)
            close(
                y2.cpu(), reference([_input(p, 200 + case + me, shape, dtype) for p in peers], ReduceOp.MAX)
            )
            checks += 3
    return checks


def check_copies(specs) -> int:
    rank, dev, checks = threadpar.get_rank(), threadpar.get_device(), 0
    for spec in specs:
        g = _group(spec)
        if not g.is_member():
            continue
        peers, n = list(g.ranks), g.size()
        me = peers.index(rank)
        for case, (dtype, shape) in enumerate((d, s) for d in COPY_DTYPES for s in SHAPES):
            root = peers[(case + 1) % n]
            t = _on_device(_input(rank, case, shape, dtype))
            g.broadcast(t, src=root)
            assert torch.equal(t.cpu(), _input(root, case, shape, dtype))

            x = _on_device(_input(rank, case, shape, dtype))
            lst = [torch.empty(shape, dtype=dtype, device=dev) for _ in range(n)]
            g.all_gather(lst, x)
            flat = torch.empty((n, *shape), dtype=dtype, device=dev)
            g.all_gather_into_tensor(flat, x, async_op=True).wait()
            for p, got, row in zip(peers, lst, flat.cpu()):
                assert torch.equal(got.cpu(), _input(p, case, shape, dtype)) and torch.equal(row, got.cpu())

            chunks = [_on_device(_input(rank, 100 + case + i, shape, dtype)) for i in range(n)]
            t = torch.empty(shape, dtype=dtype, device=dev)
            g.scatter(t, chunks if rank == root else None, src=root)
            assert torch.equal(t.cpu(), _input(root, 100 + case + me, shape, dtype))

            outs = [torch.empty(shape, dtype=dtype, device=dev) for _ in peers] if rank == root else None
            g.gather(_on_device(_input(rank, case, shape, dtype)), outs, dst=root)
            if rank == root:
                assert all(torch.equal(o.cpu(), _input(p, case, shape, dtype)) for p, o in zip(peers, outs))
            checks += 4
        # all_to_all with uneven splits: member i sends (i + j + 1) rows to member j
        sends = [torch.full((me + j + 1, 2), float(10 * rank + j), device=dev) for j in range(n)]
        recvs = [torch.empty((s + me + 1, 2), device=dev) for s in range(n)]
        g.all_to_all(recvs, sends)
        for s, got in enumerate(recvs):
            assert torch.equal(got.cpu(), torch.full((s + me + 1, 2), float(10 * peers[s] + me)))
        out = torch.empty((sum(s + me + 1 for s in range(n)), 2), device=dev)
        g.all_to_all_single(
            out, torch.cat(sends), [s + me + 1 for s in range(n)], [me + j + 1 for j in range(n)]
        )
        assert torch.equal(out.cpu(), torch.cat(recvs).cpu())
        g.barrier()
        checks += 2
    return checks


def check_large(spec=None) -> int:
    """Big enough for several lanes: an all-reduce and a broadcast of 2.5 MiB per rank."""
    g, rank, dev = _group(spec), threadpar.get_rank(), threadpar.get_device()
    t = torch.arange(655_360, dtype=torch.float32, device=dev) * (rank + 1)
    g.all_reduce(t)
    total = sum(p + 1 for p in g.ranks)
    torch.testing.assert_close(t.cpu(), torch.arange(655_360, dtype=torch.float32) * total)
    b = torch.full((655_360,), float(rank), device=dev)
    g.broadcast(b, src=g.ranks[-1])
    assert torch.equal(b.cpu(), torch.full((655_360,), float(g.ranks[-1])))
    return 2


def check_p2p() -> int:
    """Messages between every pair of ranks (across processes and within), on the world and a sub-group.

    Stream-ordered like a GPU program must be: every message is on the device before the first send, and every
    receive is posted before the first host read. On nccl a send makes the caller's stream wait for it, as
    torch's ProcessGroupNCCL does (its Work waited on the current stream), and it completes only with its
    receive; so a host copy after a send waits for the receiver, which may itself wait on the host."""
    rank, world, dev, checks = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device(), 0
    outgoing = []  # (tensor, dst, tag)
    for dst in range(world):
        if dst != rank:
            for i, dtype in enumerate(COPY_DTYPES):
                outgoing.append((_on_device(_input(rank, 1000 * dst + i, (2, 3), dtype)), dst, i))
            outgoing.append((torch.tensor(float(rank), device=dev), dst, 99))  # 0-d
            outgoing.append((torch.empty(0, 4, device=dev), dst, 98))  # empty
            for k in range(3):  # one source, one tag: arrive in order
                outgoing.append((torch.tensor([k, rank], device=dev), dst, 7))
    dp = threadpar.get_group("DP")
    peers = [r for r in dp.ranks if r != rank]
    tagged = [torch.tensor([rank, which], device=dev) for which in (1, 2)]  # (the sub-group's, below)
    for tensor, dst, tag in outgoing:
        threadpar.send(tensor, dst=dst, tag=tag)
    received = {}  # src -> (tensors of unknown shape, the 0-d, the empty one's Work, the ordered three)
    for src in range(world):
        if src != rank:
            typed = [threadpar.get_group().recv_tensor(src, tag=i) for i in range(len(COPY_DTYPES))]
            scalar = torch.empty((), device=dev)
            assert threadpar.recv(scalar, src=src, tag=99) == src
            empty = threadpar.irecv(torch.empty(0, 4, device=dev), src=src, tag=98)
            ordered = [torch.empty(2, dtype=torch.int64, device=dev) for _ in range(3)]
            for t in ordered:
                threadpar.recv(t, src=src, tag=7)
            received[src] = typed, scalar, empty, ordered
    # any-source receives, and a sub-group whose tags do not mix with the world's
    for peer in peers:
        dp.send(tagged[0], dst=peer, tag=5)
        threadpar.send(tagged[1], dst=peer, tag=5)
    anywhere = []  # (group's mark, source, tensor)
    for group, which in ((dp, 1), (threadpar.get_group(), 2)):
        for _ in peers:
            t = torch.empty(2, dtype=torch.int64, device=dev)
            anywhere.append((which, group.recv(t, src=None, tag=5), t))
    for src, (typed, scalar, empty, ordered) in received.items():  # (host reads from here on)
        for i, (got, dtype) in enumerate(zip(typed, COPY_DTYPES)):
            assert got.device == dev and got.dtype == dtype
            assert torch.equal(got.cpu(), _input(src, 1000 * rank + i, (2, 3), dtype))
        assert scalar.item() == float(src)
        empty.wait()
        assert [t.tolist() for t in ordered] == [[k, src] for k in range(3)]
        checks += len(COPY_DTYPES) + 5
    for which in (1, 2):
        sources = [src for w, src, t in anywhere if w == which]
        assert sorted(sources) == sorted(peers)
        assert all(t.tolist() == [src, which] for w, src, t in anywhere if w == which)
    threadpar.barrier()
    return checks + 2


def check_identity(processes: int, threads: int) -> int:
    rank = threadpar.get_rank()
    assert threadpar.get_world_size() == processes * threads
    assert threadpar.get_process_rank() == rank // threads
    assert threadpar.get_thread_rank() == rank % threads
    assert threadpar.is_main_rank() == (rank == 0)
    layout = threadpar.get_layout()
    assert threadpar.get_coords() == layout.coords_of(rank)
    assert threadpar.get_group("TP").ranks == tuple(layout.group_ranks("TP", rank))
    return 5


def run_all(processes: int, threads: int) -> int:
    """Everything above, inside a rank of a launch with tp=2."""
    specs = groups_to_check(threadpar.get_world_size())
    return (
        check_identity(processes, threads)
        + check_reductions(specs)
        + check_copies(specs)
        + check_large()
        + check_large("DP")
        + check_p2p()
    )


def check_pipeline(steps: int = 2) -> int:
    """A pp=2 pipeline whose stages sit in different processes (layout pp=2, dp=2 with 2 ranks per
    process: process 0 holds stage 0 of both pipelines, process 1 stage 1). 1F1B and interleaved
    schedules; after each SGD step, loss, and every parameter this stage holds, equal the whole model
    trained in this thread on the same batch."""
    from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks, reference

    from threadpar.pipeline import PipelineParallel

    checks, dp = 0, threadpar.get_coords().dp
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        inputs, targets = make_batch(8, seed=10 + dp)  # each pipeline its own batch
        model = make_model(6).to(threadpar.get_device())
        chunks = my_chunks(model, v)
        params = [p for c in chunks for p in c.parameters()]
        pipe = PipelineParallel(
            chunks,
            loss_fn=lm_loss,
            schedule=schedule,
            num_microbatches=4,
            optimizer=torch.optim.SGD(params, lr=0.1),
        )
        losses = [pipe.train_step(_on_device(inputs), _on_device(targets)) for _ in range(steps)]
        ref_loss, ref_model = reference(6, inputs, targets, steps=steps, lr=0.1)
        torch.testing.assert_close(losses[-1].cpu(), ref_loss)
        mine = {id(p) for p in params}
        expected = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            if id(p) in mine:
                torch.testing.assert_close(
                    p.detach().cpu(), expected[name].detach(), msg=lambda m, n=name: f"{n}: {m}"
                )
                checks += 1
    threads = threadpar.runtime.current().world.threads_per_process
    assert len({r // threads for r in threadpar.get_group("PP").ranks}) == 2  # the stages span processes
    return checks + check_pipeline_structures()


def check_pipeline_structures() -> int:
    """The same layout with chunks that pass tuples (an int64 mask, a bf16 leaf, a leaf that gets no
    gradient) and dicts (a 0-dim aux loss, constants): packed messages through the router. Loss and every
    gradient this stage holds equal the whole model in this thread."""
    from helpers.pipeline_models import MODELS, my_chunks, my_gradients, reference

    from threadpar.pipeline import PipelineParallel

    checks, dp = 0, threadpar.get_coords().dp
    for kind, schedule, v in (("tuple", "1f1b", 1), ("dict", "interleaved", 2)):
        make_layers, make_batch, loss_fn = MODELS[kind]
        inputs, targets = make_batch(8, seed=10 + dp)
        layers = [layer.to(threadpar.get_device()) for layer in make_layers(5)]
        chunks = my_chunks(layers, v)
        pipe = PipelineParallel(chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=4)
        loss = pipe.train_step(_on_device(inputs), _on_device(targets))
        ref_loss, ref_grads = reference(kind, 5, inputs, targets)
        torch.testing.assert_close(loss.cpu(), ref_loss)
        for name, grad in my_gradients(layers, chunks).items():
            torch.testing.assert_close(
                grad.cpu(), ref_grads[name], msg=lambda m, n=f"{kind} {name}": f"{n}: {m}"
            )
            checks += 1
    return checks


def check_ddp(runner, world: int) -> int:
    """DistributedDataParallel over every rank (the DP group spans processes) against one thread on the
    whole batch: gradients after the first step and parameters after 3 steps, for SGD with momentum in one
    bucket and for Adam with a bucket per parameter and gradients as bucket views.

    Runs in the launching thread of each process: `runner(body, world)` runs `body` on the ranks (simulated
    processes or torchrun's) and returns this process's per-rank results."""
    from helpers.ddp_reference import adam, assert_same, batches, ddp_run, mlp, reference_run, sgd

    template = mlp()  # built before any rank starts (it seeds the global generator)
    data = batches(steps=3, rows=2 * world, n_in=6, n_out=3)
    per_parameter = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}
    checks = 0
    for optimizer, options in ((sgd, {}), (adam, per_parameter)):
        expected_grads, expected_params = reference_run(template, data, optimizer)
        results = ddp_run(template, data, optimizer, world, runner=runner, **options)
        assert results, "no rank ran here"
        for grads, params in results:
            assert_same(grads, expected_grads, f"{optimizer.__name__} gradient")
            assert_same(params, expected_params, f"{optimizer.__name__} parameter")
            checks += len(grads) + len(params)
    return checks
