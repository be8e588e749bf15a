"""The double's rule that an event belongs to one device (c10/cuda/CUDAEvent.h, CUDAEvent::record), and that
waiting on it from another device's stream stays legal (CUDAEvent::block)."""

from __future__ import annotations

import threading

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.fake_device_index import fake_device_index

import threadpar


def test_an_event_recorded_on_another_devices_stream_fails_as_torch_does():
    fake = FakeCuda()
    s0, s1 = (fake.pool_stream(sim_gpu.device(i), 0) for i in (0, 1))
    assert (s0.device_index, s1.device_index) == (0, 1)
    event = fake.event()
    event.record(s0)
    event.record(s0)  # again on its own device: fine
    with pytest.raises(RuntimeError, match=r"Event device 0 does not match .* device 1 .*CUDAEvent::record"):
        event.record(s1)
    # A stream of another device may wait on it (CUDAEvent::block checks no device).
    s1.wait_event(event)
    assert fake.ordered(event.node, fake.mark(s1, "after the wait"))


def test_each_rank_thread_is_its_own_device_and_a_shared_event_cannot_cross():
    fake, recorded = FakeCuda(), threading.Event()
    shared = fake.event()

    def body():
        stream = fake.current_stream(threadpar.get_device())
        assert stream.device_index == threadpar.get_thread_rank() == fake_device_index()
        if threadpar.get_thread_rank() == 0:
            shared.record(stream)
            recorded.set()
        else:
            assert recorded.wait(5)
            shared.record(stream)

    with pytest.raises(RuntimeError, match="Event device 0 does not match recording stream's device 1"):
        run_fake_gpus(body, 2, fake)


def test_a_device_thread_is_on_its_callers_device():
    fake, seen = FakeCuda(autograd_thread=True), {}

    def body():
        device = threadpar.get_device()
        w, mine = torch.nn.Parameter(torch.ones(2, device=device)), fake.current_stream(device)
        rank = threadpar.get_thread_rank()
        # (the hook runs on the device thread: its current device, and its stream there the rank's)
        w.register_post_accumulate_grad_hook(
            lambda p: seen.update({rank: (fake_device_index(), fake.current_stream(p.device) is mine)})
        )
        w.sum().backward()

    run_fake_gpus(body, 2, fake)
    assert seen == {0: (0, True), 1: (1, True)}
