"""Issue 14, defect 4: ranks that share a CUDA device hang in backward when autograd runs their backward on the
device's one shared worker thread (shown on a test double of that thread). So a rank thread whose GPU other ranks
share runs its backward itself (issue 29: runtime/autograd_threads.py), and launch places such ranks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import threadpar
import threadpar.runtime.devices as devices_module
from threadpar.errors import CollectiveTimeoutError
from threadpar.parallel import copy_to_tp_region
from threadpar.runtime.autograd_threads import backward_on_this_thread, shares_gpu
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


@pytest.mark.parametrize("torch_distributed", [False, True])
def test_ranks_sharing_a_gpu_run_their_backward_on_their_own_threads(monkeypatch, torch_distributed):
    # Issue 29: launch places 2 ranks on the one GPU; each rank thread has autograd's device threads off
    # (runtime/autograd_threads.py), so its backward never queues behind another rank's on a shared thread.
    monkeypatch.setattr(devices_module, "cuda_device_count", lambda: 1)
    # No GPU here: what is tested is the placement and the rank threads' autograd flag, so CUDA's own calls
    # of a rank's start (its device, its generator) are stood in for.
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(
        "threadpar.runtime.context.make_generator", lambda device, seed: torch.Generator().manual_seed(seed)
    )

    def body():
        return threadpar.get_device(), torch._C._is_multithreading_enabled()

    results = threadpar.launch(body, world_size=2, backend="threads", torch_distributed=torch_distributed)
    assert results == [(torch.device("cuda", 0), False)] * 2
    assert torch._C._is_multithreading_enabled()  # the calling thread's own flag is untouched


def test_only_a_rank_whose_gpu_is_shared_turns_the_device_threads_off():
    cuda = [torch.device("cuda", i) for i in (0, 0, 1)]
    assert [shares_gpu(cuda, range(3), r) for r in range(3)] == [True, True, False]
    assert not shares_gpu([torch.device("cpu")] * 2, range(2), 0)  # CPU backward runs on the caller anyway
    assert not shares_gpu(cuda, range(2, 3), 2)  # another process's ranks are not this process's threads

    seen = []

    def other_thread():
        seen.append(torch._C._is_multithreading_enabled())

    with backward_on_this_thread(True):
        assert not torch._C._is_multithreading_enabled()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen == [True]  # thread-local: c10/core/AutogradState.cpp
    assert torch._C._is_multithreading_enabled()
