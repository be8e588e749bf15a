"""The double's CUDA graph capture and replay (fakes/fake_graph.py): each rule is one CUDA, torch or NCCL
enforces (the module docstring cites them), so code that passes the double can capture on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, FakeStream
from test_nccl_double import clique

from threadpar.comm.nccl.library import SUM, nccl_group
from threadpar.errors import GraphCaptureError, NcclError

pytestmark = pytest.mark.timeout(60)


def gpu(index=0):
    return sim_gpu.device(index)


def side(fake, device=0, name="side"):
    return FakeStream(fake, f"{name}@gpu{device}", gpu(device))


def test_capture_runs_nothing_for_real_and_each_replay_runs_the_step():
    fake = FakeCuda()
    x = torch.ones(3, device=gpu())
    graph = fake.graph()
    with fake.capture(graph, side(fake), ()):
        x.add_(1)
        y = x * 2
    torch.testing.assert_close(x.cpu(), torch.ones(3))  # (written back: the capture ran nothing)
    assert torch.isnan(y.cpu()).all()  # (allocated by the capture: garbage until a replay)
    graph.replay()
    torch.testing.assert_close((x.cpu(), y.cpu()), (torch.full((3,), 2.0), torch.full((3,), 4.0)))
    graph.replay()
    torch.testing.assert_close((x.cpu(), y.cpu()), (torch.full((3,), 3.0), torch.full((3,), 6.0)))


def test_a_capture_must_be_on_a_side_stream_and_alone_in_its_process():
    fake = FakeCuda()
    default = fake.current_stream(gpu())
    with (
        pytest.raises(RuntimeError, match="must be captured on a non-default stream"),
        fake.capture(fake.graph(), default, ()),
    ):
        pass
    inside, release = threading.Event(), threading.Event()

    def first():
        with fake.capture(fake.graph(), side(fake, name="a"), ()):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    try:
        second = side(fake, name="b")
        with (
            pytest.raises(RuntimeError, match="only one CUDA graph capture may be underway"),
            fake.capture(fake.graph(), second, ()),
        ):
            pass
    finally:
        release.set()
        thread.join()


def test_the_host_cannot_wait_for_the_device_during_a_capture():
    fake = FakeCuda()
    stream = side(fake)
    with (
        pytest.raises(GraphCaptureError, match=r"(?s)\.item\(\).*_local_scalar_dense"),
        fake.capture(fake.graph(), stream, ()),
    ):
        torch.ones(2, device=gpu()).sum().item()
    for sync in (stream.synchronize, lambda: fake.synchronize(gpu())):
        with pytest.raises(RuntimeError, match="error 900"), fake.capture(fake.graph(), stream, ()):
            sync()


def test_a_fork_must_be_joined_back_before_the_capture_ends():
    fake = FakeCuda()
    origin, branch = side(fake, name="origin"), side(fake, name="branch")
    with pytest.raises(RuntimeError, match="error 904"), fake.capture(fake.graph(), origin, ()):
        forked = fake.event()
        forked.record(origin)
        branch.wait_event(forked)
        fake.mark(branch, "kernel")
    graph = fake.graph()
    with fake.capture(graph, origin, ()):
        forked = fake.event()
        forked.record(origin)
        branch.wait_event(forked)
        fake.mark(branch, "kernel")
        back = fake.event()
        back.record(branch)
        origin.wait_event(back)
    graph.replay()


def test_captured_events_stay_inside_the_graph_and_outside_events_stay_out():
    fake = FakeCuda()
    stream, other = side(fake), side(fake, name="other")
    outside = fake.event()
    outside.record(other)
    with pytest.raises(RuntimeError, match="error 905"), fake.capture(fake.graph(), stream, ()):
        stream.wait_event(outside)
    with fake.capture(fake.graph(), stream, ()):
        captured = fake.event()
        captured.record(stream)
        with pytest.raises(RuntimeError, match="error 907"):
            captured.query()
    with pytest.raises(RuntimeError, match="error 907"):
        other.wait_event(captured)


def test_nccl_communicators_of_one_group_are_all_captured_or_none():
    fake = FakeCuda()
    (comms,) = clique([fake], [[0, 1]])
    streams = [side(fake, device=comm.device, name=f"s{comm.device}") for comm in comms]
    buffers = [torch.ones(2, device=gpu(comm.device)) for comm in comms]
    mixed = pytest.raises(NcclError, match="Either none or all communicators in a ncclGroup")
    with mixed, fake.capture(fake.graph(), streams[0], ()), nccl_group(fake.nccl):
        for comm, stream, t in zip(comms, streams, buffers):
            fake.nccl.all_reduce(t, t, SUM, comm, stream)


def test_a_host_value_read_by_a_device_op_is_refused_at_capture_naming_the_fix():
    """A capturable optimizer given its lr as a host tensor: on a GPU the launch reads the value once, at
    capture (FusedAdamWKernel.cu: lr.item() of a host lr), and every replay steps with it for ever."""
    fake = FakeCuda()
    weight = torch.nn.Parameter(torch.ones(4, device=gpu()))
    weight.grad = torch.ones(4, device=gpu())
    optimizer = torch.optim.AdamW([weight], lr=torch.tensor(0.1), capturable=True)
    optimizer.step()  # (eager: fine, the value is read at each launch)
    with (
        pytest.raises(
            GraphCaptureError, match=r"(?s)a host tensor \(\(\) torch.float32\).*Make it a device tensor"
        ),
        fake.capture(fake.graph(), side(fake), ()),
    ):
        optimizer.step()
    on_device = torch.optim.AdamW([weight], lr=torch.tensor(0.1, device=gpu()), capturable=True)
    on_device.step()
    graph = fake.graph()
    with fake.capture(graph, side(fake), ()):
        on_device.step()
    before = weight.detach().cpu()
    on_device.param_groups[0]["lr"].fill_(0.0)  # a schedule updates the device value in place: replays see it
    graph.replay()
    torch.testing.assert_close(weight.detach().cpu(), before)


@pytest.mark.parametrize(
    "read",
    ["cpu", "tolist", "item", "to_host", "host_data_to_device", "arange_to_device"],
)
def test_copies_between_host_and_device_synchronize_and_are_refused_in_a_capture(read):
    fake = FakeCuda()
    x = torch.ones(3, device=gpu())
    reads = {
        "cpu": lambda: x.cpu(),
        "tolist": lambda: x.tolist(),
        "item": lambda: x.sum().item(),
        "to_host": lambda: x.to("cpu"),
        "host_data_to_device": lambda: torch.tensor([1.0, 2.0], device=gpu()),
        "arange_to_device": lambda: torch.arange(3).to(gpu()),
    }
    with (
        pytest.raises(GraphCaptureError, match="error 900"),
        fake.capture(fake.graph(), side(fake), ()),
    ):
        reads[read]()
    with pytest.raises(TypeError, match="can't convert simgpu:0 device type tensor to numpy"):
        x.numpy()


def test_work_on_a_stream_outside_the_capture_runs_once_and_is_not_replayed():
    fake = FakeCuda()
    captured, elsewhere = torch.zeros(1, device=gpu()), torch.zeros(1, device=gpu())
    counter = torch.zeros(1)  # host work: CUDA captures none of it either
    other = side(fake, name="never-joined")
    graph = fake.graph()
    with fake.capture(graph, side(fake), ()):
        captured.add_(1)
        with fake.on_streams(other):
            elsewhere.add_(1)  # launched on a stream that never joined the capture: runs now
        counter.add_(1)
    assert (captured.item(), elsewhere.item(), counter.item()) == (0.0, 1.0, 1.0)
    graph.replay()
    graph.replay()
    assert (captured.item(), elsewhere.item(), counter.item()) == (2.0, 1.0, 1.0)
