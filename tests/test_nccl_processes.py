"""The nccl backend for groups that span processes, on the CUDA/NCCL double in simulated processes.

Each simulated process (threads of this interpreter sharing a HashStore, as threadpar.testing runs them)
has its own FakeCuda (its own device locks, streams, call log); their NCCLs share one FakeFabric, so an
NCCL operation runs once every process has issued its part. Results: every collective against float64
references (tests/procs/checks.py, shared with the hierarchical backend's tests) and against the threads
backend in one process (the workload of test_nccl_backend.py). Mechanics: each member's own call, NCCL ranks
being group indices; communicators through the store; everything through NCCL, nothing through host memory
but unique ids and the announcements of point-to-point messages.
"""

import sys

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import (
    FakeCuda,
    fake_gpu_processes,
    launch_fake_gpu_processes,
    run_fake_gpu_processes,
)
from fakes.sim_gpu import to_host
from procs import checks
from test_nccl_backend import DTYPES, assert_same, workload

import threadpar
from threadpar.comm.nccl.spanning import NcclSpanningGroup
from threadpar.errors import RankFailedError
from threadpar.testing import run_ranks


def flat(per_process):
    return [r for results in per_process for r in results]


class CopyLog:
    """A rank thread's copies between host and device (sim_gpu.CopyModel, passed on to its FakeCuda), by who
    made them: the test (its inputs and the reads of its results: each a synchronous copy, one host sync) or
    threadpar (a collective staged through host memory)."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake, self.test_syncs, self.by_threadpar = fake, 0, []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str, sync: bool, index: int) -> None:
        frame = sys._getframe(1)  # the innermost frame outside torch and the double: who asked for the copy
        while frame is not None and (
            "/torch/" in frame.f_code.co_filename or "/fakes/" in frame.f_code.co_filename
        ):
            frame = frame.f_back
        if frame is not None and "/threadpar/" in frame.f_code.co_filename:
            self.by_threadpar.append(what)
        elif sync:
            self.test_syncs += 1
        self.fake.copy(dst, src, what, sync, index)

    def __getattr__(self, name: str):
        """Everything else is its FakeCuda's (sim_gpu checks device ops against the bound model's streams)."""
        return getattr(self.fake, name)


def with_copy_log(fakes, fn):
    """`fn` on a rank thread, its copies logged: returns (fn's result, the thread's CopyLog)."""

    def body():
        log = CopyLog(fakes[threadpar.get_process_rank()])
        previous = sim_gpu.bind(log)
        try:
            return fn(), log
        finally:
            sim_gpu.bind(previous)

    return body


def assert_nothing_through_host_memory(fakes, logs) -> None:
    """threadpar made no copy between host and device and no host sync: every host sync is one of the test's
    own copies."""
    for p, fake in enumerate(fakes):
        mine = [log for log in logs if log.fake is fake]
        assert mine, f"no rank of process {p} ran"
        assert not any(log.by_threadpar for log in mine), [log.by_threadpar for log in mine]
        assert not fake.copies and len(fake.host_syncs) == sum(log.test_syncs for log in mine)


@pytest.mark.parametrize("processes,threads", [(2, 2), (2, 3), (3, 2)])
def test_every_collective_and_message_matches_direct_results(processes, threads):
    # tp=2: with 3 threads per process some TP groups span processes, others do not; the "interleaved"
    # group [W-1, 0, 1] has its member 0 in the last process. Roots and destinations rotate over members.
    fakes = fake_gpu_processes(processes)
    run = with_copy_log(fakes, lambda: checks.run_all(processes, threads))
    counts, logs = zip(*flat(run_fake_gpu_processes(run, fakes, threads, tp=2, timeout=20)))
    assert all(c > 500 for c in counts)
    for fake in fakes:  # NCCL did the collectives (the spanning groups' too), each member its own part
        comms = {c.comm.uid for c in fake.calls}
        assert len(fake.calls) > 500 and len(comms) >= 4
    assert_nothing_through_host_memory(fakes, logs)


@pytest.mark.parametrize(
    "processes,threads,groups", [(2, 2, [None, "DP", "TP"]), (2, 3, [None, "TP"])], ids=["2x2", "2x3"]
)
def test_every_dtype_and_op_matches_the_threads_backend_in_one_process(processes, threads, groups):
    world = processes * threads
    expected = run_ranks(workload, world, groups, tp=2)
    shapes = ((3, 4),)
    actual = to_host(
        flat(
            run_fake_gpu_processes(
                lambda: workload(groups, DTYPES, shapes), fake_gpu_processes(processes), threads, tp=2
            )
        )
    )
    for rank in range(world):
        assert actual[rank].keys() == expected[rank].keys()
        for key in expected[rank]:
            assert_same(actual[rank][key], expected[rank][key], f"rank {rank} {key}")


def test_each_member_issues_its_own_call_with_its_group_index_as_nccl_rank():
    fakes = fake_gpu_processes(2)

    def body():
        rank, fake, dev = threadpar.get_rank(), fakes[threadpar.get_process_rank()], threadpar.get_device()
        assert isinstance(threadpar.get_group()._backend, NcclSpanningGroup)
        # process 0 holds members 1 and 2, process 1 member 0
        g = threadpar.new_group([3, 0, 1], group_desc="odd", sort_ranks=False)
        if not g.is_member():
            return None
        mine = fake.current_stream(threadpar.get_device())
        t = torch.full((4,), float(rank), device=dev)
        produced = fake.mark(mine, "produce")
        g.all_reduce(t)
        consumed = fake.mark(mine, "consume")
        r = torch.full((3,), float(rank), device=dev)
        g.reduce(r, dst=0)  # member 1, in process 0
        y = torch.empty(2, device=dev)
        g.reduce_scatter_tensor(y, torch.arange(6.0, device=dev) + rank)
        rows = torch.empty(3, 2, device=dev)
        g.all_gather_into_tensor(rows, torch.full((2,), float(rank), device=dev))
        b = torch.full((5,), float(rank), device=dev)
        g.broadcast(b, src=3)  # member 0, in process 1
        return t, mine, produced, consumed, r, y, rows, b

    results = flat(run_fake_gpu_processes(body, fakes, 2))
    members = {0: 1, 1: 2, 3: 0}  # global rank -> index in "odd"
    for rank, m in members.items():
        t, r, y, rows, b = to_host([results[rank][i] for i in (0, 4, 5, 6, 7)])
        assert torch.equal(t, torch.full((4,), 4.0))
        assert torch.equal(r, torch.full((3,), 4.0 if rank == 0 else float(rank)))  # only dst changes
        assert torch.equal(y, 3 * torch.arange(6.0)[2 * m : 2 * m + 2] + 4)
        assert torch.equal(rows, torch.tensor([[3.0, 3.0], [0.0, 0.0], [1.0, 1.0]]))
        assert torch.equal(b, torch.full((5,), 3.0))
    for fake, here in zip(fakes, ([0, 1], [3])):
        for r in here:
            t, mine, produced, consumed = results[r][:4]
            calls = [c for c in fake.calls if c.comm.size == 3 and c.stream is mine]
            # every collective NCCL's own across processes, at its own bytes; roots are group indices
            assert [c.name for c in calls] == [
                "all_reduce",
                "reduce",
                "reduce_scatter",
                "all_gather",
                "broadcast",
            ]
            assert calls[1].extra["root"] == 1 and calls[4].extra["root"] == 0
            assert all(c.comm.rank == members[r] for c in calls)
            assert all(c.thread == f"threadpar-rank-{r}" for c in calls[1:])  # (the first made the comms)
            assert calls[0].inputs[0].data_ptr() == t.data_ptr()
            assert fake.ordered(produced, calls[0].node) and fake.ordered(calls[0].node, consumed)


def test_communicators_are_joined_through_the_store_with_member_0s_unique_id():
    fakes = fake_gpu_processes(2)

    def body():
        dev = threadpar.get_device()
        for _ in range(2):  # the second call reuses the communicators
            threadpar.all_reduce(torch.ones(2, device=dev))
            g = threadpar.new_group([3, 0, 1], group_desc="odd", sort_ranks=False)
            if g.is_member():
                g.all_reduce(torch.ones(2, device=dev))

    run_fake_gpu_processes(body, fakes, 2)
    fabric = fakes[0].nccl.fabric
    world_uid = next(c.comm.uid for c in fakes[0].calls if c.comm.size == 4)
    odd_uid = next(c.comm.uid for c in fakes[0].calls if c.comm.size == 3)
    assert fabric.id_makers == {world_uid: "threadpar-rank-0", odd_uid: "threadpar-rank-3"}  # member 0, once
    joined = sorted((c.uid, c.rank) for fake in fakes for c in fake.nccl.init_calls)
    assert joined == sorted([(world_uid, r) for r in range(4)] + [(odd_uid, m) for m in range(3)])
    assert all("threadpar-nccl-connect" in c.thread for fake in fakes for c in fake.nccl.init_calls)
    assert sum(len(fake.nccl.destroyed) for fake in fakes) == 7  # every communicator, at the launch's end


def test_messages_go_through_nccl_on_pair_communicators_in_and_across_processes():
    fakes = fake_gpu_processes(2)

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        if rank == 0:
            threadpar.send(torch.arange(3.0, device=dev), dst=1)  # same process
            threadpar.send(torch.arange(3.0, device=dev) * 2, dst=2)  # another process
            work = threadpar.isend(torch.arange(3.0, device=dev) * 3, dst=3, tag=5)
            work.wait()
            return None
        if rank == 1:
            got = torch.empty(3, device=dev)
            threadpar.recv(got, src=0)
            return got
        if rank == 2:
            return threadpar.get_group().recv_tensor(0)
        got = torch.empty(3, device=dev)
        assert threadpar.recv(got, src=None, tag=5) == 0
        return got

    results = to_host(flat(run_fake_gpu_processes(body, fakes, 2)))
    for rank, factor in ((1, 1), (2, 2), (3, 3)):
        assert torch.equal(results[rank], torch.arange(3.0) * factor)
    sent = [c for c in fakes[0].calls_named("send") if c.inputs[0].numel > 1]  # (not the connecting bytes)
    received = [c for fake in fakes for c in fake.calls_named("recv") if c.outputs[0].numel > 1]
    assert len(sent) == 3 and len(received) == 3
    assert len({c.comm.uid for c in sent}) == 3  # a communicator per pair and direction
    assert not fakes[0].copies and not fakes[1].copies


def test_scatter_gather_and_all_to_all_across_processes_are_nccl_sends_and_receives():
    fakes = fake_gpu_processes(2)

    def body():
        rank, n, dev = threadpar.get_rank(), 4, threadpar.get_device()
        sends = [torch.full((rank + 1,), float(10 * rank + j), device=dev) for j in range(n)]
        recvs = [torch.empty(s + 1, device=dev) for s in range(n)]
        threadpar.all_to_all(recvs, sends)
        for s, got in enumerate(recvs):
            assert torch.equal(got.cpu(), torch.full((s + 1,), float(10 * s + rank)))
        t = torch.empty(2, device=dev)
        chunks = [torch.full((2,), float(i), device=dev) for i in range(n)]
        threadpar.scatter(t, chunks if rank == 3 else None, src=3)
        assert torch.equal(t.cpu(), torch.full((2,), float(rank)))
        outs = [torch.empty(2, device=dev) for _ in range(n)] if rank == 0 else None
        threadpar.gather(torch.full((2,), float(rank), device=dev), outs, dst=0)
        if rank == 0:
            assert all(torch.equal(o.cpu(), torch.full((2,), float(r))) for r, o in enumerate(outs))
        threadpar.barrier()

    _, logs = zip(*flat(run_fake_gpu_processes(with_copy_log(fakes, body), fakes, 2)))
    assert_nothing_through_host_memory(fakes, logs)
    for fake in fakes:
        assert any("send" in c.name and "recv" in c.name for c in fake.calls)  # all_to_all: one group


def test_ddp_across_processes_matches_one_thread_on_the_whole_batch():
    def runner(body, world):
        return flat(run_fake_gpu_processes(body, fake_gpu_processes(2), world // 2))

    assert checks.check_ddp(runner, 4) == 2 * 4 * 12  # 2 optimizers x 4 ranks x (6 grads + 6 params)


def test_pipeline_stages_in_different_processes_match_the_whole_model():
    counts = run_fake_gpu_processes(checks.check_pipeline, fake_gpu_processes(2), 2, pp=2)
    assert all(c > 0 for c in flat(counts))


def test_the_gpu_checks_of_two_processes_on_one_gpu_pass_on_the_double():
    """benchmarks/nccl_two_hosts.py's threadpar part (two processes of one rank thread each on one GPU, run by
    gpu_check on a GPU) checked here on the double, so the first GPU runs a script known to be right."""
    from benchmarks import nccl_two_hosts

    (checks0,), (checks1,) = run_fake_gpu_processes(nccl_two_hosts.spanning_checks, fake_gpu_processes(2), 1)
    assert all(checks0.values()) and all(checks1.values()), (checks0, checks1)
    outcomes = launch_fake_gpu_processes(nccl_two_hosts.stopped, fake_gpu_processes(2), 1, timeout=20)
    for outcome in outcomes:
        assert (
            isinstance(outcome, RankFailedError)
            and outcome.rank == 1
            and "rank 1 fails on purpose" in str(outcome)
        )
