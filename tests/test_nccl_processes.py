"""The nccl backend for groups that span processes, on the CUDA/NCCL double in simulated processes.

Each simulated process (threads of this interpreter sharing a HashStore, as threadpar.testing runs them)
has its own FakeCuda (its own launch lock, streams, call log); their NCCLs share one FakeFabric, so an
NCCL collective is computed once every process has issued its part. Results: every collective against
float64 references (tests/procs/checks.py, shared with the hierarchical backend's tests) and against the
threads backend in one process (the workload of test_nccl_backend.py). Mechanics: one grouped call per
process per collective with only that process's members, in group order; communicators through the store.
"""

import pytest
import torch
from fakes.fake_cuda_nccl import fake_gpu_processes, run_fake_gpu_processes
from procs import checks
from test_nccl_backend import DTYPES, assert_same, workload

import threadpar
from threadpar.comm.nccl.spanning import NcclSpanningGroup
from threadpar.testing import run_ranks


def flat(per_process):
    return [r for results in per_process for r in results]


@pytest.mark.parametrize("processes,threads", [(2, 2), (2, 3), (3, 2)])
def test_every_collective_and_message_matches_direct_results(processes, threads):
    # tp=2: with 3 threads per process some TP groups span processes, others do not; the "interleaved"
    # group [W-1, 0, 1] has its member 0 in the last process. Roots and destinations rotate over members.
    fakes = fake_gpu_processes(processes)
    run = lambda: checks.run_all(processes, threads)  # noqa: E731
    counts = run_fake_gpu_processes(run, fakes, threads, tp=2, timeout=20)
    assert all(c > 500 for c in flat(counts))
    for fake in fakes:  # NCCL did the collectives (the spanning groups' too), each process its own part
        comms = {c.comms[0].uid for c in fake.calls}
        assert len(fake.calls) > 500 and len(comms) >= 4  # (all_gather: one call, not one per member)


@pytest.mark.parametrize(
    "processes,threads,groups", [(2, 2, [None, "DP", "TP"]), (2, 3, [None, "TP"])], ids=["2x2", "2x3"]
)
def test_every_dtype_and_op_matches_the_threads_backend_in_one_process(processes, threads, groups):
    world = processes * threads
    expected = run_ranks(workload, world, groups, tp=2)
    shapes = ((3, 4),)
    actual = flat(
        run_fake_gpu_processes(
            lambda: workload(groups, DTYPES, shapes), fake_gpu_processes(processes), threads, tp=2
        )
    )
    for rank in range(world):
        assert actual[rank].keys() == expected[rank].keys()
        for key in expected[rank]:
            assert_same(actual[rank][key], expected[rank][key], f"rank {rank} {key}")


def test_one_grouped_call_per_process_with_only_its_members_in_group_order():
    fakes = fake_gpu_processes(2)

    def body():
        rank, fake = threadpar.get_rank(), fakes[threadpar.get_process_rank()]
        assert isinstance(threadpar.get_group()._backend, NcclSpanningGroup)
        # process 0 holds members 1 and 2, process 1 member 0
        g = threadpar.new_group([3, 0, 1], group_desc="odd", sort_ranks=False)
        if not g.is_member():
            return None
        mine = fake.current_stream(threadpar.get_device())
        t = torch.full((4,), float(rank))
        produced = fake.mark(mine, "produce")
        g.all_reduce(t)
        consumed = fake.mark(mine, "consume")
        r = torch.full((3,), float(rank))
        g.reduce(r, dst=0)  # member 1, in process 0
        y = torch.empty(2)
        g.reduce_scatter_tensor(y, torch.arange(6.0) + rank)
        rows = torch.empty(3, 2)
        g.all_gather_into_tensor(rows, torch.full((2,), float(rank)))
        b = torch.full((5,), float(rank))
        g.broadcast(b, src=3)  # member 0, in process 1
        return t, produced, consumed, r, y, rows, b

    results = flat(run_fake_gpu_processes(body, fakes, 2))
    members = {0: 1, 1: 2, 3: 0}  # global rank -> index in "odd"
    for rank, m in members.items():
        t, _, _, r, y, rows, b = results[rank]
        assert torch.equal(t, torch.full((4,), 4.0))
        assert torch.equal(r, torch.full((3,), 4.0 if rank == 0 else float(rank)))  # only dst changes
        assert torch.equal(y, 3 * torch.arange(6.0)[2 * m : 2 * m + 2] + 4)
        assert torch.equal(rows, torch.tensor([[3.0, 3.0], [0.0, 0.0], [1.0, 1.0]]))
        assert torch.equal(b, torch.full((5,), 3.0))
    for fake, here in zip(fakes, ([0, 1], [3])):
        calls = [c for c in fake.calls if c.comms[0].size == 3]
        # every collective NCCL's own across processes, at its own bytes; roots are NCCL ranks (group indices)
        assert [c.name for c in calls] == [
            "all_reduce",
            "reduce",
            "reduce_scatter",
            "all_gather",
            "broadcast",
        ]
        assert calls[1].extra["root"] == 1 and calls[4].extra["root"] == 0
        for call in calls:
            assert [c.rank for c in call.comms] == [members[r] for r in here]  # group order, local only
            assert [c.thread for c in call.comms] == [f"threadpar-rank-{r}" for r in here]
            assert call.lock_held and call.thread in {f"threadpar-rank-{r}" for r in here}
            assert all(s in fake.comm_streams and s.priority == -1 for s in call.streams)
            assert len({id(s) for s in call.streams}) == len(here)
        first = calls[0]
        for i, r in enumerate(here):
            t, produced, consumed = results[r][:3]
            assert first.inputs[i].data_ptr() == t.data_ptr()
            assert fake.ordered(produced, first.nodes[i]), "the op must wait for the caller's earlier work"
            assert fake.ordered(first.nodes[i], consumed), "the caller's later work must wait for the op"


def test_communicators_are_joined_through_the_store_with_member_0s_unique_id():
    fakes = fake_gpu_processes(2)

    def body():
        for _ in range(2):  # the second call reuses the communicators
            threadpar.all_reduce(torch.ones(2))
            g = threadpar.new_group([3, 0, 1], group_desc="odd", sort_ranks=False)
            if g.is_member():
                g.all_reduce(torch.ones(2))

    run_fake_gpu_processes(body, fakes, 2)
    fabric = fakes[0].nccl.fabric
    world_uid = next(c.comms[0].uid for c in fakes[0].calls if c.comms[0].size == 4)
    odd_uid = next(c.comms[0].uid for c in fakes[0].calls if c.comms[0].size == 3)
    assert fabric.id_makers == {world_uid: "threadpar-rank-0", odd_uid: "threadpar-rank-3"}  # member 0, once
    joined = [(c.uid, c.rank, c.thread) for fake in fakes for c in fake.nccl.init_calls]
    assert sorted(joined) == sorted(
        [(world_uid, r, f"threadpar-rank-{r}") for r in range(4)]
        + [(odd_uid, m, f"threadpar-rank-{r}") for r, m in ((3, 0), (0, 1), (1, 2))]
    )  # each member joins in its own thread, once


def test_messages_in_a_process_are_device_copies_and_between_processes_go_through_the_router():
    fakes = fake_gpu_processes(2)

    def body():
        rank = threadpar.get_rank()
        if rank == 0:
            threadpar.send(torch.arange(3.0), dst=1)  # same process
            threadpar.send(torch.arange(3.0) * 2, dst=2)  # another process
            work = threadpar.isend(torch.arange(3.0) * 3, dst=3, tag=5)
            assert work.is_completed()  # handed over already
            return None
        if rank == 1:
            got = torch.empty(3)
            threadpar.recv(got, src=0)
            return got
        if rank == 2:
            return threadpar.get_group().recv_tensor(0)
        got = torch.empty(3)
        assert threadpar.recv(got, src=None, tag=5) == 0
        return got

    results = flat(run_fake_gpu_processes(body, fakes, 2))
    for rank, factor in ((1, 1), (2, 2), (3, 3)):
        assert torch.equal(results[rank], torch.arange(3.0) * factor)
    assert len(fakes[0].copies) == 1 and fakes[0].copies[0].lock_held  # rank 0 -> rank 1 only
    assert not fakes[1].copies


def test_copies_between_processes_go_through_host_memory_after_synchronizing_the_callers_stream():
    fakes = fake_gpu_processes(2)

    def body():
        rank, n = threadpar.get_rank(), 4
        sends = [torch.full((rank + 1,), float(10 * rank + j)) for j in range(n)]
        recvs = [torch.empty(s + 1) for s in range(n)]
        threadpar.all_to_all(recvs, sends)
        for s, got in enumerate(recvs):
            assert torch.equal(got, torch.full((s + 1,), float(10 * s + rank)))
        t = torch.empty(2)
        threadpar.scatter(t, [torch.full((2,), float(i)) for i in range(n)] if rank == 3 else None, src=3)
        assert torch.equal(t, torch.full((2,), float(rank)))
        outs = [torch.empty(2) for _ in range(n)] if rank == 0 else None
        threadpar.gather(torch.full((2,), float(rank)), outs, dst=0)
        if rank == 0:
            assert all(torch.equal(o, torch.full((2,), float(r))) for r, o in enumerate(outs))
        threadpar.barrier()

    run_fake_gpu_processes(body, fakes, 2)
    for fake in fakes:
        assert not fake.calls and not fake.copies  # no NCCL, and no device copies: through host memory
        assert (
            len(fake.host_syncs) == 3 * 2
        )  # all_to_all, scatter, gather: each member's stream (not barrier)


def test_ddp_across_processes_matches_one_thread_on_the_whole_batch():
    def runner(body, world):
        return flat(run_fake_gpu_processes(body, fake_gpu_processes(2), world // 2))

    assert checks.check_ddp(runner, 4) == 2 * 4 * 12  # 2 optimizers x 4 ranks x (6 grads + 6 params)


def test_pipeline_stages_in_different_processes_match_the_whole_model():
    counts = run_fake_gpu_processes(checks.check_pipeline, fake_gpu_processes(2), 2, pp=2)
    assert all(c > 0 for c in flat(counts))
