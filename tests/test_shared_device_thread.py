"""Issue 14, defect 4: ranks that share a CUDA device on the threads backend hang in backward, so launch refuses
that configuration. The hang is shown on a test double of autograd's shared per-device worker thread."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import threadpar
import threadpar.runtime.devices as devices_module
from threadpar.errors import CollectiveTimeoutError
from threadpar.parallel import copy_to_tp_region
from threadpar.testing import run_ranks


class SharedDeviceThread:
    """Autograd's worker for one CUDA device, as torch/csrc/autograd/engine.cpp runs it:
    - Engine::start_device_threads creates one ReadyQueue and one worker thread per device, once per process;
    - Engine::ready_queue sends every node whose device is not the CPU to device_ready_queues_[device.index()],
      whatever graph task (backward call) the node belongs to: every rank's backward on that GPU lands in the
      same queue;
    - the worker (Engine::thread_main) pops one node and runs its function to the end before popping the next;
    - the thread that called backward() waits on its graph task's future (Engine::execute) meanwhile.
    The double: a single-worker executor running each backward whole, the caller blocked on the result."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autograd-cuda-0")

    def backward(self, loss: torch.Tensor) -> None:
        self._executor.submit(loss.backward).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def tp_backward_step(device_thread_of):
    """One rank: a forward through copy_to_tp_region (identity) whose backward all-reduces the gradient over
    the group, the same collective-in-backward as every TP layer and as DDP's last bucket."""
    x = torch.ones(4, requires_grad=True)
    loss = copy_to_tp_region(x, threadpar.get_group()).sum()
    device_thread_of(threadpar.get_rank()).backward(loss)
    return x.grad


def test_backward_collectives_of_ranks_on_one_shared_device_thread_hang():
    shared = SharedDeviceThread()
    failures = []
    lock = threading.Lock()

    def body():
        try:
            tp_backward_step(lambda rank: shared)
        except CollectiveTimeoutError as error:  # the first backward waits for a rank queued behind it
            with lock:
                failures.append(str(error))

    try:
        run_ranks(body, 2, timeout=0.5)
    finally:
        shared.close()
    assert failures and all("did not arrive" in f for f in failures), failures


def test_the_same_backward_with_a_device_thread_per_rank_works():
    # One GPU per rank (the nccl backend's placement): each rank's backward has its device's own thread.
    threads = {0: SharedDeviceThread(), 1: SharedDeviceThread()}
    try:
        grads = run_ranks(lambda: tp_backward_step(threads.__getitem__), 2, timeout=30)
    finally:
        for t in threads.values():
            t.close()
    for grad in grads:
        torch.testing.assert_close(grad, torch.full((4,), 2.0))  # summed over the 2 ranks


def test_launch_refuses_several_ranks_on_one_gpu_before_any_rank_runs(monkeypatch):
    monkeypatch.setattr(devices_module, "cuda_device_count", lambda: 1)
    ran = threading.Event()
    with pytest.raises(
        threadpar.ConfigError, match=r"2 ranks on 1 GPU\(s\): several ranks on one CUDA device"
    ):
        threadpar.launch(ran.set, world_size=2, backend="threads")
    assert not ran.is_set()
