"""The NCCL double refuses what torch.cuda.nccl and NCCL would get wrong across processes, so that no code
path passes against it while failing on real torch (torch/csrc/cuda/nccl.cpp sizes and indexes by the
LOCAL lists: reduce's root, all_gather's output, reduce_scatter's count)."""

import threading

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, FakeStream, fake_gpu_processes


def clique(fakes, held):
    """Communicators of one clique; held[p] = the NCCL ranks process p holds. Returns comms per process."""
    size = sum(len(ranks) for ranks in held)
    uid = fakes[0].nccl.unique_id()
    comms = [[None] * len(ranks) for ranks in held]

    def join(p, i, r):
        with fakes[p].device_guard(torch.device("cpu")):
            comms[p][i] = fakes[p].nccl.init_rank(size, uid, r)

    threads = [
        threading.Thread(target=join, args=(p, i, r)) for p, rs in enumerate(held) for i, r in enumerate(rs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return comms


def in_processes(fakes, comms, call):
    """call(p, fake, comms of p) in one thread per process at once; returns what each raised (or None)."""
    errors = [None] * len(fakes)

    def run(p):
        try:
            with fakes[p].launch_lock:
                call(p, fakes[p], comms[p])
        except Exception as error:
            errors[p] = error

    threads = [threading.Thread(target=run, args=(p,)) for p in range(len(fakes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def streams(fake, n):
    return [FakeStream(fake, f"s{i}", torch.device("cpu"), -1) for i in range(n)]


def test_reduce_root_must_index_the_local_inputs():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    ins = [torch.ones(3), torch.ones(3)]
    with pytest.raises(RuntimeError, match="root 2 is not an index into 2 inputs"):
        fake.nccl.reduce(ins, root=2, streams=streams(fake, 2), comms=comms)


def test_a_cross_process_reduce_whose_root_rank_has_no_output_is_refused():
    # NCCL rank 1 is local index 0 of process 1, which passes its output at local index 1 (rank 2)
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 3], [1, 2]])

    def call(p, fake, mine):
        fake.nccl.reduce([torch.ones(2), torch.ones(2)], root=1, streams=streams(fake, 2), comms=mine)

    errors = in_processes(fakes, comms, call)
    assert all("rank 1 is the root, but torch.cuda.nccl gave it no output buffer" in str(e) for e in errors)


def test_all_gather_output_is_the_local_count_times_the_input_and_overruns_across_processes():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])
    with pytest.raises(RuntimeError, match="output numel must be 3 \\(1 local inputs of 3\\)"):
        fakes[0].nccl.all_gather(
            [torch.ones(3)], [torch.empty(6)], streams=streams(fakes[0], 1), comms=comms[0]
        )

    def call(p, fake, mine):
        fake.nccl.all_gather([torch.ones(3)], [torch.empty(3)], streams=streams(fake, 1), comms=mine)

    errors = in_processes(fakes, comms, call)
    assert all("all_gather over 2 ranks writes 6 elements" in str(e) and "overrun" in str(e) for e in errors)


def test_reduce_scatter_counts_by_the_local_inputs_and_overruns_across_processes():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0], [1]])

    def call(p, fake, mine):  # what torch accepts: count = 4 / 1 local input
        fake.nccl.reduce_scatter([torch.ones(4)], [torch.empty(4)], streams=streams(fake, 1), comms=mine)

    errors = in_processes(fakes, comms, call)
    assert all("reduce_scatter over 2 ranks reads 8 elements" in str(e) for e in errors)


def test_a_call_must_hold_every_communicator_of_the_clique_this_process_has_in_rank_order():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])
    with pytest.raises(AssertionError, match="holds ranks \\[0, 1\\] of the clique but passed \\[0\\]"):
        fakes[0].nccl.all_reduce([torch.ones(2)], streams=streams(fakes[0], 1), comms=comms[0][:1])
    with pytest.raises(AssertionError, match="not in increasing rank order"):
        fakes[0].nccl.all_reduce([torch.ones(2)] * 2, streams=streams(fakes[0], 2), comms=comms[0][::-1])


def test_a_collective_across_processes_is_computed_once_every_part_is_issued():
    fakes = fake_gpu_processes(2)
    comms = clique(fakes, [[0, 1], [2]])
    tensors = [[torch.full((2,), 1.0), torch.full((2,), 2.0)], [torch.full((2,), 4.0)]]

    def call(p, fake, mine):
        fake.nccl.all_reduce(tensors[p], streams=streams(fake, len(mine)), comms=mine)

    assert in_processes(fakes, comms, call) == [None, None]
    assert all(torch.equal(t, torch.full((2,), 7.0)) for ts in tensors for t in ts)


def test_broadcast_range_checks_root_against_the_local_list_and_always_sends_from_nccl_rank_0():
    # torch 2.13: THCPModule_nccl_broadcast checks root, torch::cuda::nccl::broadcast calls ncclBcast(..., 0, ...)
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    ins = [torch.full((2,), 5.0), torch.full((2,), 7.0)]
    with pytest.raises(RuntimeError, match="invalid root"):
        fake.nccl.broadcast(ins, root=2, streams=streams(fake, 2), comms=comms)
    with fake.launch_lock:
        fake.nccl.broadcast(ins, root=1, streams=streams(fake, 2), comms=comms)
    assert all(torch.equal(t, torch.full((2,), 5.0)) for t in ins)  # rank 0's data, not root 1's
