"""The NCCL double's own rules, on several ranks and simulated processes (what a one-GPU contract run cannot
reach): each is a way real NCCL hangs, corrupts data or refuses a call, and the double must refuse it too,
so that no code path passes against the double while failing on a GPU. Sources: tests/fakes/fake_nccl.py."""

from __future__ import annotations

import threading

import pytest
import torch
from fakes import fake_nccl
from fakes.fake_cuda_nccl import FakeCuda, FakeStream, fake_gpu_processes, run_fake_gpus

import threadpar
from threadpar.comm.nccl.library import SUM, nccl_group
from threadpar.errors import NcclError


def clique(fakes, held):
    """Communicators of one clique; held[p] = the NCCL ranks process p holds, each on its own device (its
    position in the process). Returns comms per process."""
    size = sum(len(ranks) for ranks in held)
    uid = fakes[0].nccl.get_unique_id()
    comms = [[None] * len(ranks) for ranks in held]

    def join(p, i, r):
        comms[p][i] = fakes[p].nccl.comm_init_rank(size, uid, r, i)

    threads = [
        threading.Thread(target=join, args=(p, i, r)) for p, rs in enumerate(held) for i, r in enumerate(rs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return comms


def in_processes(fakes, comms, call):
    """call(p, fake, comms of p) in one thread per process at once, inside one NCCL group each; returns what
    each raised (or None)."""
    errors = [None] * len(fakes)

    def run(p):
        try:
            with fakes[p].launch_lock, nccl_group(fakes[p].nccl):
                call(p, fakes[p], comms[p])
        except Exception as error:
            errors[p] = error

    threads = [threading.Thread(target=run, args=(p,)) for p in range(len(fakes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def stream(fake, name="s"):
    return FakeStream(fake, name, torch.device("cpu"), -1)


def test_a_collective_across_processes_is_computed_once_every_part_is_issued():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])
    tensors = [[torch.full((2,), 1.0), torch.full((2,), 2.0)], [torch.full((2,), 4.0)]]

    def call(p, fake, mine):
        for t, comm in zip(tensors[p], mine):
            fake.nccl.all_reduce(t, t, SUM, comm, stream(fake))

    assert in_processes(fakes, comms, call) == [None, None]
    assert all(torch.equal(t, torch.full((2,), 7.0)) for ts in tensors for t in ts)


def test_a_reduce_whose_root_has_no_output_is_refused():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])

    def call(p, fake, mine):
        fake.nccl.reduce(torch.ones(2), None, 1, SUM, mine[0], stream(fake))

    errors = in_processes(fakes, comms, call)
    assert all("rank 1 is the root, but passed no recvbuff" in str(e) for e in errors)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_buffers_too_small_for_the_communicators_size_are_refused(op):
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])

    def call(p, fake, mine):
        for comm in mine:  # sized for this process's members, not the clique's 3
            n = len(mine)
            if op == "all_gather":
                fake.nccl.all_gather(torch.ones(2), torch.empty(2 * n), comm, stream(fake))
            else:
                fake.nccl.reduce_scatter(torch.ones(2 * n), torch.empty(2), SUM, comm, stream(fake))

    errors = in_processes(fakes, comms, call)
    assert all("buffer overrun" in str(e) for e in errors), errors


def test_collectives_that_differ_across_ranks_are_named():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])

    def call(p, fake, mine):
        fake.nccl.all_reduce(torch.ones(2 + p), torch.empty(2 + p), SUM, mine[0], stream(fake))

    errors = in_processes(fakes, comms, call)
    assert all("collectives differ" in str(e) for e in errors), errors


def test_operations_of_a_group_launch_at_its_end():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    xs = [torch.full((2,), 1.0), torch.full((2,), 2.0)]
    with fake.launch_lock:
        fake.nccl.group_start()
        for x, comm in zip(xs, comms):
            fake.nccl.all_reduce(x, x, SUM, comm, stream(fake))
        assert torch.equal(xs[0], torch.full((2,), 1.0))  # nothing launched yet
        fake.nccl.group_end()
    assert all(torch.equal(x, torch.full((2,), 3.0)) for x in xs)
    assert len(fake.calls_named("all_reduce")) == 1  # one launch of both ranks' parts


def test_sends_and_receives_match_per_peer_in_order_and_must_agree_on_size():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    got = [torch.empty(2), torch.empty(3)]

    def call(p, fake, mine):
        if p == 0:
            fake.nccl.send(torch.full((2,), 1.0), 1, mine[0], stream(fake))
            fake.nccl.send(torch.full((3,), 2.0), 1, mine[0], stream(fake))
        else:
            for t in got:
                fake.nccl.recv(t, 0, mine[0], stream(fake))

    assert in_processes(fakes, comms, call) == [None, None]
    assert torch.equal(got[0], torch.full((2,), 1.0)) and torch.equal(got[1], torch.full((3,), 2.0))

    def mismatched(p, fake, mine):
        if p == 0:
            fake.nccl.send(torch.ones(2), 1, mine[0], stream(fake))
        else:
            fake.nccl.recv(torch.empty(5), 0, mine[0], stream(fake))

    errors = in_processes(fakes, comms, mismatched)
    assert any("they must match" in str(e) for e in errors), errors


def test_two_threads_driving_one_device_at_once_is_a_violation():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    other = fake.nccl.comm_init_all([0, 1])  # a second communicator on the same devices
    fake.nccl.group_start()
    fake.nccl.all_reduce(torch.ones(1), torch.empty(1), SUM, comms[0], stream(fake))
    seen = []

    def intruder():
        try:
            fake.nccl.all_reduce(torch.ones(1), torch.empty(1), SUM, other[0], stream(fake))
        except RuntimeError as error:
            seen.append(str(error))

    t = threading.Thread(target=intruder)
    t.start()
    t.join()
    fake.nccl.all_reduce(torch.ones(1), torch.empty(1), SUM, comms[1], stream(fake))
    fake.nccl.group_end()
    assert seen and "another thread's group holds operations on that device" in seen[0]
    assert fake.nccl.violations


def test_abort_ends_a_pending_operation_with_an_error(monkeypatch):
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    errors = []

    def lonely():  # process 1 never issues its part: the kernel would wait for ever
        try:
            fakes[0].nccl.all_reduce(torch.ones(1), torch.empty(1), SUM, comms[0][0], stream(fakes[0]))
        except RuntimeError as error:
            errors.append(str(error))

    t = threading.Thread(target=lonely)
    t.start()
    while not fakes[0].calls:  # (its part is posted once logged)
        t.join(0.01)
    fakes[0].nccl.comm_abort(comms[0][0])
    t.join(5)
    assert not t.is_alive() and "aborted (ncclCommAbort)" in errors[0]
    with pytest.raises(NcclError, match="ncclInvalidArgument"):
        fakes[0].nccl.comm_get_async_error(comms[0][0])  # freed


def test_an_init_whose_peers_never_join_fails_in_the_double(monkeypatch):
    monkeypatch.setattr(fake_nccl, "INIT_TIMEOUT_S", 0.2)
    fake = FakeCuda()
    with pytest.raises(NcclError, match="ranks \\[0\\] of 2 joined"):
        fake.nccl.comm_init_rank(2, fake.nccl.get_unique_id(), 0, 0)


def test_threadpar_never_calls_torch_cuda_nccl_init_rank():
    """torch.cuda.nccl.init_rank raises SystemError on CPython 3.10-3.12 (conftest breaks it for every test);
    the nccl backend makes its communicators through NCCL's C API, so a launch on it still works."""
    with pytest.raises(SystemError, match="PY_SSIZE_T_CLEAN"):
        torch.cuda.nccl.init_rank(1, b"\0" * 128, 0)

    def body():
        x = torch.ones(2)
        threadpar.all_reduce(x)
        return x

    for x in run_fake_gpus(body, 2, FakeCuda()):
        assert torch.equal(x, torch.full((2,), 2.0))
