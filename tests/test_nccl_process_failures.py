"""The nccl backend across processes when processes disagree or one does not come: a clear error on every
rank, naming the process and its ranks, never a hang. Also how launch picks the backend under torchrun."""

import importlib
import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import fake_gpu_processes, launch_fake_gpu_processes

import threadpar
from threadpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError, RankFailedError
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv

# Modules by name: threadpar.runtime's `launch` attribute is the function.
launch_module = importlib.import_module("threadpar.runtime.launch")
devices_module = importlib.import_module("threadpar.runtime.devices")


def ones(n: int) -> torch.Tensor:
    """n ones on the calling rank's device (the double's GPU)."""
    return torch.ones(n, device=threadpar.get_device())


def zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, device=threadpar.get_device())


def test_a_process_that_skips_a_groups_first_collective_is_named_without_a_hang():
    def body():
        if threadpar.get_process_rank() == 0:
            threadpar.all_reduce(ones(2))

    start = time.monotonic()
    outcomes = launch_fake_gpu_processes(body, fake_gpu_processes(2), 2, timeout=1.0)
    assert time.monotonic() - start < 10
    failed = outcomes[0]
    assert isinstance(failed, RankFailedError) and isinstance(failed.error, CollectiveTimeoutError)
    assert "process 1 (ranks [2, 3]) did not reach it" in str(failed.error)
    assert "all_reduce(float32[2], op=SUM, creating=NCCL communicators) #1 on group 'WORLD'" in str(
        failed.error
    )
    assert isinstance(outcomes[1], threadpar.ThreadparError)  # the other process fails too (no hang)


def _mismatch(numel_in_process_1: int, first_op: bool, check: bool):
    def body():
        if not first_op:
            threadpar.all_reduce(ones(3))  # communicators made, the processes agreed once
        numel = 4 if threadpar.get_process_rank() == 0 else numel_in_process_1
        try:
            threadpar.all_reduce(zeros(numel))
        except CollectiveMismatchError as error:
            return str(error)
        return "no error"

    outcomes = launch_fake_gpu_processes(body, fake_gpu_processes(2), 2, check_collectives=check, timeout=5.0)
    return [m for per_process in outcomes for m in per_process]


def test_processes_that_disagree_on_the_first_collective_raise_a_mismatch_on_every_rank():
    messages = _mismatch(5, first_op=True, check=False)
    assert all("collective mismatch on group 'WORLD'" in m and "across processes" in m for m in messages)
    assert "process 0: #1 all_reduce(float32[4], op=SUM, creating=NCCL communicators)" in messages[0]
    assert (
        "process 1: #1 all_reduce(float32[5], op=SUM, creating=NCCL communicators)   <-- differs"
        in messages[0]
    )


def test_with_check_collectives_every_collective_is_checked_between_processes():
    """The member that completes a call's check in its process asks the other processes too (a store round
    trip): a mismatch stops both processes' launches, each naming both processes' calls."""

    def body():
        threadpar.all_reduce(ones(3))  # communicators made, the processes agreed once
        threadpar.all_reduce(zeros(4 if threadpar.get_process_rank() == 0 else 5))
        while True:  # the launch's stop ends this
            time.sleep(0.01)

    outcomes = launch_fake_gpu_processes(body, fake_gpu_processes(2), 2, check_collectives=True, timeout=5.0)
    for outcome in outcomes:
        assert isinstance(outcome, RankFailedError), outcome
        assert "process 1: #2 all_reduce(float32[5], op=SUM)" in str(outcome)


def test_with_check_collectives_a_process_that_skips_a_later_collective_is_named():
    """Process 0's ranks issue #2, process 1's do not. Rank 0 issues first: its #2 waits on the device for
    process 1 from then on; rank 1 comes last, so it asks process 1 (the check), from a little later. The
    device's wait expires first, but the check is what names the cause: the watchdog leaves the wait to it."""
    issued = threading.Event()

    def body():
        threadpar.all_reduce(ones(2))
        if threadpar.get_rank() == 0:
            threadpar.all_reduce(ones(2))  # returns once issued: the device waits for process 1
            issued.set()
        elif threadpar.get_rank() == 1:
            assert issued.wait(30)
            time.sleep(0.5)  # the watchdog (every 0.1 s) watches rank 0's #2 before the check starts
            threadpar.all_reduce(ones(2))

    outcomes = launch_fake_gpu_processes(body, fake_gpu_processes(2), 2, check_collectives=True, timeout=2.0)
    assert isinstance(outcomes[0].error, CollectiveTimeoutError)
    assert "#2 on group 'WORLD'" in str(outcomes[0].error) and "process 1 (ranks [2, 3])" in str(
        outcomes[0].error
    )


def test_threadpar_check_collectives_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("THREADPAR_CHECK_COLLECTIVES", raising=False)
    assert launch_module.check_collectives_requested() is False
    monkeypatch.setenv("THREADPAR_CHECK_COLLECTIVES", "1")
    assert launch_module.check_collectives_requested() is True
    monkeypatch.setenv("THREADPAR_CHECK_COLLECTIVES", "yes")
    with pytest.raises(ConfigError, match="THREADPAR_CHECK_COLLECTIVES='yes': set it to 1"):
        launch_module.check_collectives_requested()


def _world_args(monkeypatch, n_cuda: int, local_rank: int, backend: str, check_collectives: bool = False):
    seen = {}
    monkeypatch.setattr(launch_module, "cuda_device_count", lambda: n_cuda)
    # The GPUs are stood in for: so is a CUDA build with NCCL.
    monkeypatch.setattr(devices_module, "nccl_built", lambda: True)
    monkeypatch.setattr(launch_module, "process_world", lambda *args, **kwargs: seen.update(args=args))
    env = ProcessEnv(local_rank, 2, local_rank, 2)
    config = LaunchConfig(
        backend=backend, timeout=5.0, threads_per_process=2, check_collectives=check_collectives
    )
    launch_module._multi_process_world(env, config, 2)
    return seen["args"]


def test_check_collectives_is_a_launch_option_the_environment_can_turn_on(monkeypatch):
    monkeypatch.delenv("THREADPAR_CHECK_COLLECTIVES", raising=False)
    assert _world_args(monkeypatch, 4, 0, "nccl")[1].check_collectives is False
    assert _world_args(monkeypatch, 4, 0, "nccl", check_collectives=True)[1].check_collectives is True
    monkeypatch.setenv("THREADPAR_CHECK_COLLECTIVES", "1")
    assert _world_args(monkeypatch, 4, 0, "nccl")[1].check_collectives is True
    monkeypatch.setenv("THREADPAR_CHECK_COLLECTIVES", "0")  # the variable only turns the check on
    assert _world_args(monkeypatch, 4, 0, "nccl", check_collectives=True)[1].check_collectives is True


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_torchrun_with_a_gpu_per_thread_uses_nccl_across_processes(monkeypatch, backend):
    _, _, layout, chosen, devices, *_ = _world_args(monkeypatch, 4, 1, backend)
    assert chosen == "nccl" and layout.world_size == 4
    assert devices == (torch.device("cuda", 2), torch.device("cuda", 3))  # process 1's block of GPUs
    with pytest.raises(ConfigError, match="need 4 GPUs, but this process sees 3"):
        _world_args(monkeypatch, 3, 0, backend)


def test_a_failure_in_another_process_stops_ranks_waiting_for_it_at_the_first_collective():
    def body():
        if threadpar.get_rank() == 2:
            raise ValueError("boom on purpose")
        threadpar.all_reduce(ones(2))  # process 0 waits for process 1 here (before NCCL's init)

    start = time.monotonic()
    outcomes = launch_fake_gpu_processes(body, fake_gpu_processes(2), 2, timeout=30.0)
    assert time.monotonic() - start < 10  # the stop, not the 30 s timeout
    for outcome in outcomes:
        assert isinstance(outcome, RankFailedError) and outcome.rank == 2
        assert "boom on purpose" in str(outcome)
