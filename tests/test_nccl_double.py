"""The NCCL double's own rules, on several ranks and simulated processes (what a one-GPU contract run cannot
reach): each is a way real NCCL hangs, corrupts data or refuses a call, and the double must fail on it too,
so that no code path passes against the double while failing on a GPU. Sources: tests/fakes/fake_nccl.py,
tests/fakes/fake_device.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fakes import fake_device, sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, FakeStream, fake_gpu_processes, run_fake_gpus
from fakes.fake_device import HangError
from fakes.fake_device_index import bound_to

import threadpar
from threadpar.comm.nccl.library import IN_PROGRESS, SUM, nccl_group
from threadpar.errors import NcclError


def gpu(index=0):
    """The double's GPU `index` (NCCL's buffers are device memory: a host tensor is a violation)."""
    return sim_gpu.device(index)


def clique(fakes, held, blocking=True):
    """Communicators of one clique; held[p] = the NCCL ranks process p holds, each on its own fake GPU (its
    position in the process). Returns comms per process."""
    size = sum(len(ranks) for ranks in held)
    uid = fakes[0].nccl.get_unique_id()
    comms = [[None] * len(ranks) for ranks in held]

    def join(p, i, r):
        comms[p][i] = fakes[p].nccl.comm_init_rank_config(size, uid, r, i, blocking)

    threads = [
        threading.Thread(target=join, args=(p, i, r)) for p, rs in enumerate(held) for i, r in enumerate(rs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return comms


def stream(fake, device=0, name="s"):
    """A stream of fake GPU `device` (a communicator's calls must use its own device's streams)."""
    return FakeStream(fake, f"{name}@gpu{device}", gpu(device), -1)


def issue(fake, comms, call):
    """call(i, comm, stream) for each communicator, each from a thread standing for its device's, inside one
    NCCL group per thread; returns what each raised (or None)."""
    errors = [None] * len(comms)

    def run(i):
        try:
            with bound_to(comms[i].device), nccl_group(fake.nccl):
                call(i, comms[i], stream(fake, comms[i].device))
        except Exception as error:
            errors[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.fixture
def short_waits(monkeypatch):
    """The double gives up where a GPU would wait for ever after 0.3 s (instead of 10 s)."""
    monkeypatch.setattr(fake_device, "WAIT_TIMEOUT_S", 0.3)


@pytest.fixture(autouse=True)
def connect_at_creation(monkeypatch):
    """Collectives connected when communicators are created (NCCL_RUNTIME_CONNECT=0, as threadpar sets it:
    comm/nccl/bootstrap.py), so that a first collective issued from one thread before its peers' does not
    block that thread (point to point connects on first use all the same)."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")


def together(*calls):
    """Run each call on a thread of its own at once (ranks that issue at the same time); their errors."""
    errors = [None] * len(calls)

    def run(i):
        try:
            calls[i]()
        except Exception as error:
            errors[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_a_call_returns_at_once_and_its_stream_waits_for_the_peers():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    xs = [torch.full((2,), 1.0, device=gpu(0)), torch.full((2,), 2.0, device=gpu(1))]
    streams = [stream(fake, 0), stream(fake, 1)]
    with bound_to(0):
        fake.nccl.all_reduce(xs[0], xs[0], SUM, comms[0], streams[0])  # returns: rank 1 has not called
        done = fake.event()
        done.record(streams[0])
    assert not done.query()  # the kernel waits for rank 1's part, on the device
    waiter = threading.Thread(target=done.synchronize)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # a host that synchronizes waits for rank 1 too
    with bound_to(1):
        fake.nccl.all_reduce(xs[1], xs[1], SUM, comms[1], streams[1])
    waiter.join(10)
    assert not waiter.is_alive() and done.query()
    fake.synchronize(gpu())
    assert all(torch.equal(x.cpu(), torch.full((2,), 3.0)) for x in xs)


def test_a_collective_across_processes_runs_once_every_part_is_issued():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])
    values = [[1.0, 2.0], [4.0]]  # process p's member i, on its GPU i
    tensors = [[torch.full((2,), v, device=gpu(i)) for i, v in enumerate(vs)] for vs in values]
    for p in range(2):
        assert issue(fakes[p], comms[p], lambda i, c, s, p=p: fakes[p].nccl.all_reduce(
            tensors[p][i], tensors[p][i], SUM, c, s)) == [None] * len(comms[p])  # fmt: skip
    for fake in fakes:
        fake.synchronize(gpu())
    assert all(torch.equal(t.cpu(), torch.full((2,), 7.0)) for ts in tensors for t in ts)


def test_a_reduce_whose_root_has_no_output_fails_its_kernel():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    for p in range(2):
        issue(
            fakes[p],
            comms[p],
            lambda i, c, s, p=p: fakes[p].nccl.reduce(
                torch.ones(2, device=gpu(c.device)), None, 1, SUM, c, s
            ),
        )
    with pytest.raises(RuntimeError, match="rank 1 is the root, but passed no recvbuff"):
        fakes[0].synchronize(gpu())


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_buffers_too_small_for_the_communicators_size_fail_the_kernel(op):
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])

    def call(p):
        n = len(comms[p])  # sized for this process's members, not the clique's 3

        def one(i, comm, s):
            dev = gpu(comm.device)
            if op == "all_gather":
                fakes[p].nccl.all_gather(torch.ones(2, device=dev), torch.empty(2 * n, device=dev), comm, s)
            else:
                fakes[p].nccl.reduce_scatter(
                    torch.ones(2 * n, device=dev), torch.empty(2, device=dev), SUM, comm, s
                )

        return one

    for p in range(2):
        issue(fakes[p], comms[p], call(p))
    with pytest.raises(RuntimeError, match="buffer overrun"):
        fakes[1].synchronize(gpu())


def test_collectives_that_differ_across_ranks_fail_their_kernels():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    for p, count in ((0, 2), (1, 3)):  # (each process's one member is on its GPU 0)
        issue(fakes[p], comms[p], lambda i, c, s, p=p, n=count: fakes[p].nccl.all_reduce(
            torch.ones(n, device=gpu()), torch.empty(n, device=gpu()), SUM, c, s))  # fmt: skip
    assert "collectives differ" in fakes[0].nccl.fabric.mismatches[0]
    for fake in fakes:
        with pytest.raises(RuntimeError, match="collectives differ"):
            fake.synchronize(gpu())  # every rank's kernel failed


def test_operations_of_a_group_launch_at_its_end():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    xs = [torch.full((2,), 1.0, device=gpu(0)), torch.full((2,), 2.0, device=gpu(1))]
    fake.nccl.group_start()  # one thread, both ranks in one group: as ncclCommInitAll's users do
    with bound_to(0):
        fake.nccl.all_reduce(xs[0], xs[0], SUM, comms[0], stream(fake, 0))
    with bound_to(1):
        fake.nccl.all_reduce(xs[1], xs[1], SUM, comms[1], stream(fake, 1))
    assert not fake.calls  # nothing launched yet
    fake.nccl.group_end()
    fake.synchronize(gpu())
    assert all(torch.equal(x.cpu(), torch.full((2,), 3.0)) for x in xs)
    assert len(fake.calls_named("all_reduce")) == 2  # one kernel per stream


def test_sends_and_receives_match_per_peer_in_order_and_must_agree_on_size():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    got = [torch.empty(2, device=gpu()), torch.empty(3, device=gpu())]

    def sends(i, comm, s):
        fakes[0].nccl.send(torch.full((2,), 1.0, device=gpu()), 1, comm, s)
        fakes[0].nccl.send(torch.full((3,), 2.0, device=gpu()), 1, comm, s)

    def recvs(i, comm, s):
        for t in got:
            fakes[1].nccl.recv(t, 0, comm, s)

    # (the first send connects its peer inside its group end, waiting for it: both ranks issue at once)
    assert together(lambda: issue(fakes[0], comms[0], sends), lambda: issue(fakes[1], comms[1], recvs)) == [
        None,
        None,
    ]
    fakes[1].synchronize(gpu())
    got = [t.cpu() for t in got]
    assert torch.equal(got[0], torch.full((2,), 1.0)) and torch.equal(got[1], torch.full((3,), 2.0))

    issue(fakes[0], comms[0], lambda i, c, s: fakes[0].nccl.send(torch.ones(2, device=gpu()), 1, c, s))
    issue(fakes[1], comms[1], lambda i, c, s: fakes[1].nccl.recv(torch.empty(5, device=gpu()), 0, c, s))
    with pytest.raises(RuntimeError, match="they must match"):
        fakes[1].synchronize(gpu())


def test_a_send_blocks_its_stream_until_the_receive_runs(short_waits):
    """Two ranks that send to each other, then receive, on one communicator and one stream each: NCCL's
    "blocking for the GPU" send makes that a cycle, which the double reports instead of waiting for ever."""
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    streams = [stream(fake, 0), stream(fake, 1)]

    def connect(me):  # a grouped exchange first: connected, as threadpar's pairs are
        with bound_to(me), nccl_group(fake.nccl):
            fake.nccl.send(torch.ones(1, device=gpu(me)), 1 - me, comms[me], streams[me])
            fake.nccl.recv(torch.empty(1, device=gpu(me)), 1 - me, comms[me], streams[me])

    assert together(lambda: connect(0), lambda: connect(1)) == [None, None]
    for me in (0, 1):
        with bound_to(me):
            fake.nccl.send(torch.ones(4, device=gpu(me)), 1 - me, comms[me], streams[me])
            fake.nccl.recv(torch.empty(4, device=gpu(me)), 1 - me, comms[me], streams[me])
    with pytest.raises(HangError, match="wait for each other in a cycle"):
        fake.synchronize(gpu())


@pytest.mark.parametrize("communicators", [1, 2])
def test_a_communicators_launches_run_in_issue_order_whatever_their_streams(short_waits, communicators):
    """src/enqueue.cc, ncclLaunchPrepare/ncclLaunchFinish: each launch waits for the communicator's previous
    one. Two ranks that send to each other before they receive, a send on one stream and the receive on
    another: on one communicator (or one split sharing its resources) that is a cycle, as with one stream; on
    a communicator per direction (threadpar's pairs of plain send/recv) it is not."""
    fake = FakeCuda()
    cliques = [clique([fake], [[0, 1]])[0] for _ in range(communicators)]
    out, into = cliques[0], cliques[-1]  # the one that carries 0 -> 1, and 1 -> 0
    sends, recvs = (
        [stream(fake, 0, "send"), stream(fake, 1, "send")],
        [stream(fake, 0, "r"), stream(fake, 1, "r")],
    )

    def connect(me):
        with bound_to(me), nccl_group(fake.nccl):
            for comms in cliques:
                fake.nccl.send(torch.ones(1, device=gpu(me)), 1 - me, comms[me], sends[me])
                fake.nccl.recv(torch.empty(1, device=gpu(me)), 1 - me, comms[me], recvs[me])

    assert together(lambda: connect(0), lambda: connect(1)) == [None, None]
    got = [torch.empty(4, device=gpu(0)), torch.empty(4, device=gpu(1))]
    for me in (0, 1):
        mine, theirs = (out, into) if me == 0 else (into, out)
        with bound_to(me):
            fake.nccl.send(torch.full((4,), float(me), device=gpu(me)), 1 - me, mine[me], sends[me])
            fake.nccl.recv(got[me], 1 - me, theirs[me], recvs[me])
    if communicators == 1:
        with pytest.raises(HangError, match="wait for each other in a cycle"):
            fake.synchronize(gpu(0))
    else:
        fake.synchronize(gpu(0))
        assert [g[0].item() for g in got] == [1.0, 0.0]


def test_collectives_of_two_groups_in_opposite_orders_on_two_ranks_are_a_hang():
    fake = FakeCuda()
    (a,) = clique([fake], [[0, 1]])
    (b,) = clique([fake], [[0, 1]])
    streams = [stream(fake, 0), stream(fake, 1)]
    order = {0: (a, b), 1: (b, a)}  # rank 1 calls group b's first
    for me in (0, 1):
        with bound_to(me):
            for comms in order[me]:
                x, y = torch.ones(2, device=gpu(me)), torch.empty(2, device=gpu(me))
                fake.nccl.all_reduce(x, y, SUM, comms[me], streams[me])
    with pytest.raises(HangError, match="wait for each other in a cycle"):
        fake.synchronize(gpu())


def test_two_threads_issuing_on_one_device_at_once_is_a_violation():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    other = fake.nccl.comm_init_all([0, 1])  # a second communicator on the same devices
    s0 = stream(fake, 0)
    fake.nccl.group_start()
    fake.nccl.all_reduce(torch.ones(1, device=gpu()), torch.empty(1, device=gpu()), SUM, comms[0], s0)
    # (this thread holds device 0 now)
    seen = []

    def intruder():
        try:
            fake.nccl.all_reduce(torch.ones(1, device=gpu()), torch.empty(1, device=gpu()), SUM, other[0], s0)
        except RuntimeError as error:
            seen.append(str(error))

    t = threading.Thread(target=intruder)
    t.start()
    t.join()
    fake.nccl.group_end()
    assert seen and "host threads racing to launch NCCL on same device" in seen[0]
    assert fake.nccl.violations


def test_a_stream_of_another_device_is_refused():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    with pytest.raises(
        NcclError, match=r"ncclUnhandledCudaError.*belongs to fake GPU 1, the communicator to GPU 0"
    ):
        x, y = torch.ones(1, device=gpu()), torch.empty(1, device=gpu())
        fake.nccl.all_reduce(x, y, SUM, comms[0], stream(fake, 1))


def test_a_host_buffer_or_one_on_another_gpu_is_a_violation():
    """NCCL's kernels read and write device memory of the communicator's GPU (src/misc/argcheck.cc,
    CudaPtrCheck; unchecked, a host pointer faults the kernel)."""
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    mine, other = torch.ones(2, device=gpu(0)), torch.ones(2, device=gpu(1))
    with pytest.raises(RuntimeError, match=r"sendbuff is a tensor on cpu, not GPU memory"):
        fake.nccl.all_reduce(torch.ones(2), mine, SUM, comms[0], stream(fake, 0))
    with pytest.raises(RuntimeError, match=r"allocated on device 1 mismatchs with NCCL device 0"):
        fake.nccl.all_reduce(mine, other, SUM, comms[0], stream(fake, 0))
    assert len(fake.nccl.violations) == 2 and not fake.calls  # nothing was launched
    fake.nccl.violations.clear()


def test_abort_ends_this_ranks_pending_kernel_and_freed_communicators_fail_loudly():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    s = stream(fakes[0], 0)
    x, y = torch.ones(1, device=gpu()), torch.empty(1, device=gpu())
    fakes[0].nccl.all_reduce(x, y, SUM, comms[0][0], s)  # process 1 never issues it
    done = fakes[0].event()
    done.record(s)
    assert not done.query()
    fakes[0].nccl.comm_abort(comms[0][0])
    assert done.query()  # the kernel ended (its output holds whatever it holds): its stream went on
    for use in (
        lambda: fakes[0].nccl.comm_get_async_error(comms[0][0]),
        lambda: fakes[0].nccl.all_reduce(x, y, SUM, comms[0][0], s),
        lambda: fakes[0].nccl.comm_abort(comms[0][0]),
    ):
        with pytest.raises(RuntimeError, match="use after free"):
            use()
    assert len(fakes[0].nccl.violations) == 3


def test_destroy_waits_for_the_communicators_operations(short_waits):
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    x, y = torch.ones(1, device=gpu()), torch.empty(1, device=gpu())
    fakes[0].nccl.all_reduce(x, y, SUM, comms[0][0], stream(fakes[0]))
    with pytest.raises(HangError, match="ncclCommDestroy waiting for all_reduce"):
        fakes[0].nccl.comm_destroy(comms[0][0])  # its peer never issues it: on a GPU, for ever


def test_a_blocking_init_whose_peers_never_join_would_wait_for_ever(short_waits):
    fake = FakeCuda()
    with pytest.raises(HangError, match=r"ranks \[0\] of 2 joined.*NCCL waits for ever"):
        fake.nccl.comm_init_rank(2, fake.nccl.get_unique_id(), 0, 0)


def test_a_nonblocking_communicator_is_in_progress_until_its_peers_join_and_unusable_until_then():
    fake = FakeCuda()
    uid = fake.nccl.get_unique_id()
    comm = fake.nccl.comm_init_rank_config(2, uid, 0, 0, False)  # returns at once
    assert fake.nccl.comm_get_async_error(comm) == IN_PROGRESS
    with pytest.raises(
        NcclError, match=r"ncclInvalidArgument.*before the previous operation returned ncclSuccess"
    ):
        fake.nccl.all_reduce(
            torch.ones(1, device=gpu()), torch.empty(1, device=gpu()), SUM, comm, stream(fake, 0)
        )
    with bound_to(1):
        fake.nccl.comm_init_rank_config(2, uid, 1, 1, False)
    assert fake.nccl.comm_get_async_error(comm) == 0
    fake.nccl.violations.clear()


def test_a_first_send_connects_its_peer_blocking_the_host_on_a_blocking_communicator(short_waits):
    """NCCL connects point to point on first use, inside the group end, waiting for the peer to connect too
    (src/transport.cc); on a nonblocking communicator the call returns ncclInProgress instead."""
    fake = FakeCuda()
    (blocking,) = clique([fake], [[0, 1]])
    with bound_to(0), pytest.raises(HangError, match="connecting send/recv"):
        fake.nccl.send(torch.ones(2, device=gpu(0)), 1, blocking[0], stream(fake, 0))
    (nonblocking,) = clique([fake], [[0, 1]], blocking=False)
    with bound_to(0):
        fake.nccl.send(torch.ones(2, device=gpu(0)), 1, nonblocking[0], stream(fake, 0))
        assert fake.nccl.comm_get_async_error(nonblocking[0]) == IN_PROGRESS
    with bound_to(1):
        fake.nccl.recv(torch.empty(2, device=gpu(1)), 0, nonblocking[1], stream(fake, 1))
        assert settled(fake, nonblocking[1]) == 0
    with bound_to(0):
        assert settled(fake, nonblocking[0]) == 0


def settled(fake, comm, timeout=5.0):
    """Poll ncclCommGetAsyncError until it stops saying ncclInProgress (as nccl.h tells users of a
    nonblocking communicator to); what it says then."""
    deadline = time.monotonic() + timeout
    while (state := fake.nccl.comm_get_async_error(comm)) == IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(1e-4)
    return state


def test_threadpar_never_calls_torch_cuda_nccl_init_rank():
    """torch.cuda.nccl.init_rank raises SystemError on CPython 3.10-3.12 (conftest breaks it for every test);
    the nccl backend makes its communicators through NCCL's C API, so a launch on it still works."""
    with pytest.raises(SystemError, match="PY_SSIZE_T_CLEAN"):
        torch.cuda.nccl.init_rank(1, b"\0" * 128, 0)

    def body():
        x = torch.ones(2, device=threadpar.get_device())
        threadpar.all_reduce(x)
        return x.cpu()

    for x in run_fake_gpus(body, 2, FakeCuda()):
        assert torch.equal(x, torch.full((2,), 2.0))
