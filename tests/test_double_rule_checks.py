"""The double's rules that no other CPU test checked on their own (tests/fakes/rules.py names them): stream
waits, the stream pool, device ordinals, a graph's capture and replay states, the mixed group. Each names the
torch, CUDA or NCCL source its fake cites."""

from __future__ import annotations

import pytest
import torch
from fakes import sim_gpu, sim_gpu_streams
from fakes.fake_cuda_nccl import STREAMS_PER_POOL, FakeCuda, FakeStream
from fakes.fake_device import HangError
from fakes.fake_device_index import bound_to
from test_nccl_double import clique

from threadpar.comm.nccl.library import SUM
from threadpar.errors import NcclError

pytestmark = pytest.mark.timeout(60)


def gpu(index: int = 0) -> torch.device:
    return sim_gpu.device(index)


def test_a_wait_is_for_the_events_latest_record_only():
    """cudaStreamWaitEvent waits for the event's most recent record (CUDA runtime API): work recorded before it
    is ordered before the waiting stream's later work, a record made after the wait is not."""
    fake = FakeCuda()
    first, second = fake.pool_stream(gpu(), 0), fake.pool_stream(gpu(), 0)
    event = fake.event()
    before = fake.mark(first, "before the record")
    event.record(first)
    second.wait_event(event)
    waiter = fake.mark(second, "after the wait")
    later = fake.mark(first, "before the second record")
    event.record(first)
    assert fake.ordered(before, waiter)
    assert not fake.ordered(later, waiter)


def test_pool_streams_come_round_robin_from_32_per_priority():
    """c10/cuda/CUDAStream.cpp, getStreamFromPool: 32 streams per device and priority level, handed out in turn;
    torch.cuda.Stream wrappers of one stream are equal and hash alike (torch/cuda/streams.py)."""
    fake = FakeCuda()
    low = [fake.pool_stream(gpu(), 0) for _ in range(2 * STREAMS_PER_POOL)]
    assert STREAMS_PER_POOL == 32
    assert len({id(s) for s in low[:32]}) == 32
    assert all(low[i] is low[i + 32] for i in range(32))
    high = fake.pool_stream(gpu(), -1)
    assert all(high is not s for s in low)
    previous = sim_gpu.bind(fake)
    try:
        a, b = sim_gpu_streams.current_stream(gpu()), sim_gpu_streams.current_stream(gpu())
        assert a == b and hash(a) == hash(b) and a is not b
    finally:
        sim_gpu.bind(previous)


def test_an_invalid_device_ordinal_is_refused():
    """c10/cuda/CUDAFunctions.cpp: set_device past the device count fails (cudaErrorInvalidDevice)."""
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        sim_gpu.set_device(sim_gpu.DEVICE_COUNT)
    assert sim_gpu.current_device() == 0


def test_a_graph_is_captured_once():
    """aten/src/ATen/cuda/CUDAGraph.cpp, capture_begin: a graph that owns a capture cannot capture again."""
    fake = FakeCuda()
    stream = FakeStream(fake, "side@gpu0", gpu())
    x = torch.ones(2, device=gpu())
    graph = fake.graph()
    with fake.capture(graph, stream, ()):
        x.add_(1)
    with pytest.raises(RuntimeError, match="captured once"), fake.capture(graph, stream, ()):
        x.add_(1)


def test_a_graph_replays_only_after_a_successful_capture():
    """aten/src/ATen/cuda/CUDAGraph.cpp, replay: TORCH_CHECK(capture_ended_, "Called CUDAGraph::replay without a
    preceding successful capture."), which reset() clears."""
    fake = FakeCuda()
    with pytest.raises(RuntimeError, match="not captured"):
        fake.graph().replay()
    graph = fake.graph()
    with fake.capture(graph, FakeStream(fake, "side@gpu0", gpu()), ()):
        torch.ones(2, device=gpu()).add_(1)
    graph.replay()
    graph.reset()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        graph.replay()


def test_a_replay_inside_a_capture_is_refused():
    """The double refuses a replay on the capturing thread (fake_graph.FakeGraph.replay: error 900)."""
    fake = FakeCuda()
    x = torch.ones(2, device=gpu())
    graph = fake.graph()
    with fake.capture(graph, FakeStream(fake, "a@gpu0", gpu()), ()):
        x.add_(1)
    with (
        pytest.raises(RuntimeError, match="error 900"),
        fake.capture(fake.graph(), FakeStream(fake, "b@gpu0", gpu()), ()),
    ):
        graph.replay()


def test_the_double_refuses_blocking_and_nonblocking_communicators_in_one_group():
    """The double's rule (fake_nccl.FakeNccl.group_end). NCCL's own check is narrower (tests/fakes/rules.py,
    nccl-mixed-blocking-group): this test pins what the double does today."""
    fake = FakeCuda()
    nccl = fake.nccl
    blocking = nccl.comm_init_rank(1, nccl.get_unique_id(), 0, 0)
    nonblocking = nccl.comm_init_rank_config(1, nccl.get_unique_id(), 0, 0, False)
    assert nccl.comm_get_async_error(nonblocking) == 0  # (a world of one has joined at once)
    stream = fake.pool_stream(gpu(), 0)
    x, y = torch.ones(2, device=gpu()), torch.ones(2, device=gpu())
    nccl.group_start()
    nccl.all_reduce(x, x, SUM, blocking, stream)
    nccl.all_reduce(y, y, SUM, nonblocking, stream)
    with pytest.raises(NcclError, match="Blocking and nonblocking communicators are not allowed"):
        nccl.group_end()
    nccl.comm_destroy(blocking)
    nccl.comm_abort(nonblocking)


def test_the_last_destroy_of_a_clique_with_a_graph_alive_would_wait_for_ever():
    """NCCL >= 2.26 (src/init.cc, commReclaim -> commDestroySync): the last destroy of a clique's communicators
    in a process polls until every CUDA graph that captured work on them is destroyed; the double raises there.
    With the graph reset first, the destroy returns."""
    for reset_first in (False, True):
        fake = FakeCuda(nccl_version=(2, 27, 3))
        (comms,) = clique([fake], [[0, 1]])
        x = torch.ones(2, device=gpu(0))
        graph = fake.graph()
        with bound_to(0), fake.capture(graph, FakeStream(fake, "side@gpu0", gpu(0)), ()):
            fake.nccl.all_reduce(x, x, SUM, comms[0], fake.current_stream(gpu(0)))
        if reset_first:
            graph.reset()
        with bound_to(0):
            fake.nccl.comm_destroy(comms[0])  # (not the last: returns)
        with bound_to(1):
            if reset_first:
                fake.nccl.comm_destroy(comms[1])
                assert not fake.nccl.violations
            else:
                with pytest.raises(HangError, match=r"CUDA graph.*alive"):
                    fake.nccl.comm_destroy(comms[1])
