"""The GPU tier of the double's rules (tests/fakes/rules.py): each test asserts on a real GPU the fact a rule of
the CUDA/NCCL double enforces on CPU. The facts run in processes of their own (tests/cuda/gpu_facts.py runs them): plain
torch with no double installed (a registered double would be torch's accelerator), and NCCL calls that wait for
ever can be killed. Skipped without GPUs (tests/conftest.py); on one H200 the tier's share is about a minute."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.gpus import gpus_or_skip

from threadpar.comm.nccl.library import IN_PROGRESS

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("gpu_facts.py")
HANG_S = 20.0  # how long a call NCCL never returns from is watched before its process is killed

# The facts that leave their process able to run the next one, in one process (captures that succeed last).
TOGETHER = (
    "stream_pool", "copy_synchronizes", "wait_latest_record", "device_synchronize_one_gpu", "event_one_device",
    "same_device", "numpy_refused", "device_generator", "pinned_memory", "current_device_per_thread",
    "invalid_ordinal", "autocast_policy", "backward_error", "deepcopy_device", "torch_init_rank",
    "capture_states", "capture_records_not_runs", "graph_generators", "host_scalar_frozen", "captured_event",
    "optimizer_capturable", "outside_stream_runs_once",
)  # fmt: skip


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NCCL_LAUNCH_MODE", None)  # (NCCL's default, PARALLEL: ranks of one process launch independently)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_facts(*names: str, timeout: float = 240, **env: str | None) -> dict[str, dict[str, Any]]:
    """Each named fact's record; a fact whose process died inside it is recorded as failed (with the process's
    stderr), and the facts after it run in a new process."""
    records: dict[str, dict[str, Any]] = {}
    remaining = list(names)
    while remaining:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *remaining],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env(**env),
        )  # fmt: skip
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                records[record["fact"]] = record
        left = [n for n in remaining if n not in records]
        if left:  # (the process ended inside left[0])
            why = f"its process ended inside it (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            records[left[0]] = {"fact": left[0], "ok": False, "error": why}
        remaining = left[1:]
    return records


def observed(records: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    record = records[name]
    if "skip" in record:
        pytest.skip(record["skip"])
    assert record["ok"], record["error"]
    return record


@pytest.fixture(scope="module")
def facts() -> dict[str, dict[str, Any]]:
    gpus_or_skip(1)
    return run_facts(*TOGETHER)


# -- NCCL -----------------------------------------------------------------------------------------------------------
def test_a_blocking_init_whose_peer_never_joins_waits_for_ever():
    """nccl.h: ncclCommInitRank blocks until every rank joined; there is no timeout. Watched for HANG_S."""
    gpus_or_skip(1)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "blocking_init_waits"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(),
    )  # fmt: skip
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        seen = []
        while {"fact": "blocking_init_waits", "started": True} not in seen:
            line = lines.get(timeout=120)  # (torch and NCCL start within seconds)
            seen.append(json.loads(line) if line.startswith("{") else line)
            assert proc.poll() is None or not lines.empty(), f"the process ended early: {seen}"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=HANG_S)
    finally:
        proc.kill()
        proc.wait()


def test_a_nonblocking_init_whose_peer_never_joins_stays_in_progress_and_refuses_calls():
    """src/init.cc, ncclCommEnsureReady: a call before the communicator reports ncclSuccess is ncclInvalidArgument."""
    gpus_or_skip(1)
    seen = observed(run_facts("nonblocking_init_in_progress"), "nonblocking_init_in_progress")
    assert seen["states"] == [IN_PROGRESS]
    assert "ncclAllReduce failed: ncclInvalidArgument" in seen["call"]


def test_a_collective_returns_at_once_and_its_stream_waits_for_the_peer():
    gpus_or_skip(2)
    seen = observed(run_facts("stream_waits_for_peer", NCCL_RUNTIME_CONNECT="0"), "stream_waits_for_peer")
    assert seen["returned_alone"] and seen["done_before_peer"] is False
    assert seen["values"] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_communicators_launches_run_in_issue_order_whatever_their_streams():
    gpus_or_skip(2)
    seen = observed(run_facts("launch_order", NCCL_RUNTIME_CONNECT="0"), "launch_order")
    assert seen["sleep_to_second_ms"] > 0, seen  # the second launch waited for the first, behind the sleep
    assert seen["values"] == [[[2.0, 2.0], [2.0, 2.0]], [[2.0, 2.0], [2.0, 2.0]]]


def test_a_groups_operations_are_launched_at_its_end():
    gpus_or_skip(2)
    seen = observed(run_facts("group_launches_at_end", NCCL_RUNTIME_CONNECT="0"), "group_launches_at_end")
    assert seen["event_inside_group_done"] is True
    assert seen["values"] == [[2.0, 2.0], [2.0, 2.0]]


def test_a_send_blocks_its_stream_until_the_receive_runs():
    gpus_or_skip(2)
    seen = observed(run_facts("send_waits_for_receive"), "send_waits_for_receive")
    assert seen["send_done_before_receive"] is False and seen["received"] is True


def test_abort_ends_the_communicators_pending_kernel_and_its_stream_goes_on():
    gpus_or_skip(2)
    seen = observed(run_facts("abort_ends_kernels", NCCL_RUNTIME_CONNECT="0"), "abort_ends_kernels")
    assert seen["pending_before_abort"] and seen["stream_went_on"]


def test_a_first_collective_connects_blocking_the_host_until_the_peer_issues():
    gpus_or_skip(2)
    seen = observed(
        run_facts("first_collective_connects", NCCL_RUNTIME_CONNECT=None), "first_collective_connects"
    )
    assert seen["returned_before_peer"] is False and seen["returned_after_peer"]
    assert seen["values"] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_nonblocking_group_end_returns_in_progress():
    gpus_or_skip(2)
    seen = observed(run_facts("nonblocking_group_end"), "nonblocking_group_end")
    assert seen["ready"] == [0, 0] and seen["group_end"] == IN_PROGRESS and seen["settled"] == [0, 0]
    assert seen["values"] == [[3.0, 3.0], [3.0, 3.0]]


def test_torchs_nccl_init_rank_raises_system_error_on_this_python(facts):
    if not (3, 10) <= sys.version_info[:2] < (3, 13):
        pytest.skip("the '#' format needs PY_SSIZE_T_CLEAN on CPython 3.10-3.12 only")
    error = observed(facts, "torch_init_rank")["error"]
    assert error is not None and error.startswith("SystemError") and "PY_SSIZE_T_CLEAN" in error, error


# -- streams, events, copies ----------------------------------------------------------------------------------------
def test_a_wait_is_for_the_events_latest_record_only(facts):
    seen = observed(facts, "wait_latest_record")
    assert seen["first_to_waited_ms"] > -10  # the wait waited for the first record (after a second's sleep)
    assert seen["waited_to_second_ms"] > 100  # and not for the record made after it (another second later)


def test_pool_streams_come_round_robin_from_32_per_priority(facts):
    seen = observed(facts, "stream_pool")
    assert seen["distinct_of_32"] == 32 and seen["wraps"] and seen["high_priority_apart"]
    assert seen["equal_and_same_hash"]


def test_a_copy_to_the_host_waits_for_the_stream_unless_pinned_and_non_blocking(facts):
    seen = observed(facts, "copy_synchronizes")
    assert seen["cpu_waited"] and seen["item_waited"] and seen["tolist_waited"]
    assert seen["pinned_non_blocking_waited"] is False and seen["pinned_arrived"]


def test_a_device_synchronize_waits_for_that_gpus_streams_only(facts):
    seen = observed(facts, "device_synchronize_one_gpu")
    assert seen["gpu1_done_after_sync_of_gpu0"] is False and seen["gpu1_done_after_its_own"]


def test_an_event_recorded_on_another_devices_stream_fails(facts):
    error = observed(facts, "event_one_device")["error"]
    assert error is not None and "does not match recording stream's device" in error, error


# -- device tensors -------------------------------------------------------------------------------------------------
def test_mixing_host_and_device_tensors_is_refused_where_the_double_refuses_it(facts):
    """The table tests/test_sim_gpu.py asserts for the double (there against FakeTensor's model)."""
    seen = {k: v for k, v in observed(facts, "same_device").items() if k not in ("fact", "ok")}
    assert seen == {
        "add": "refused", "add_scalar": "ran", "mm": "refused", "cat": "refused",
        "where_scalar": "ran", "mul_": "refused", "index_cpu": "ran",
    }  # fmt: skip


def test_numpy_of_a_device_tensor_is_refused_naming_cpu(facts):
    error = observed(facts, "numpy_refused")["error"]
    assert error is not None and error.startswith(
        "TypeError: can't convert cuda:0 device type tensor to numpy"
    )
    assert "Tensor.cpu()" in error


def test_random_ops_draw_from_the_devices_own_generator(facts):
    seen = observed(facts, "device_generator")
    assert seen["repeats"] and seen["host_untouched"]


def test_pinned_host_memory(facts):
    seen = observed(facts, "pinned_memory")
    assert seen["pinned"] is True and seen["plain"] is False


def test_the_current_device_is_per_thread(facts):
    seen = observed(facts, "current_device_per_thread")
    assert (seen["thread_current"], seen["thread_factory"], seen["main_factory"]) == (0, 0, 1)


def test_an_invalid_device_ordinal_is_refused(facts):
    error = observed(facts, "invalid_ordinal")["error"]
    # (cudaSetDevice's cudaErrorInvalidDevice, "invalid device ordinal", unless torch checks the index first)
    assert error is not None and re.search(r"invalid device( ordinal)?|device index", error), error


def test_autocast_casts_as_the_double_does(facts):
    """The dtypes tests/test_sim_gpu.py asserts for torch.autocast on the double."""
    seen = observed(facts, "autocast_policy")
    assert seen["dtypes"] == {
        "linear": "torch.bfloat16", "mse_loss": "torch.float32", "softmax": "torch.float32",
        "norm": "torch.float32", "addcmul": "torch.float32", "plain": "torch.bfloat16",
    }  # fmt: skip
    assert seen["default"] == "torch.float16"
    assert seen["bce"] is not None and "unsafe to autocast" in seen["bce"]


def test_an_error_raised_in_a_backward_hook_reaches_the_caller(facts):
    seen = observed(facts, "backward_error")
    assert seen["error"] is not None and seen["error"].startswith("Failed: from the hook"), seen["error"]
    assert seen["goes_on"] == [3.0, 3.0, 3.0]


def test_deepcopy_of_a_device_tensor_stays_on_the_device_and_refuses_non_leaves(facts):
    seen = observed(facts, "deepcopy_device")
    assert seen["device"] == "cuda:0" and seen["equal"] and seen["own_memory"]
    assert seen["non_leaf"] is not None and "graph leaves" in seen["non_leaf"]


# -- CUDA graphs ----------------------------------------------------------------------------------------------------
def test_a_capture_on_the_default_stream_is_refused(facts):
    error = observed(facts, "capture_states")["default_stream"]
    assert error is not None and "must be captured on a non-default stream" in error, error


def test_a_graph_is_captured_once(facts):
    error = observed(facts, "capture_states")["second_capture"]
    assert error is not None and "already owns a captured graph" in error, error


def test_a_graph_replays_only_after_a_successful_capture(facts):
    seen = observed(facts, "capture_states")
    for when in ("replay_uncaptured", "replay_after_reset"):
        assert seen[when] is not None and "without a preceding successful capture" in seen[when], seen[when]


def test_a_capture_records_without_running_and_each_replay_runs(facts):
    seen = observed(facts, "capture_records_not_runs")
    assert seen["after_capture"] == [1.0] * 4
    assert seen["after_one_replay"] == [2.0] * 4 and seen["after_two"] == [4.0] * 4


def test_random_ops_draw_anew_at_every_replay(facts):
    assert observed(facts, "graph_generators")["differ"]


def test_work_on_a_stream_outside_the_capture_runs_once(facts):
    seen = observed(facts, "outside_stream_runs_once")
    assert seen["outside_after_capture"] == 1.0 and seen["outside_after_replays"] == 1.0
    assert seen["captured"] == 3.0


def test_a_host_scalar_read_in_a_capture_is_frozen_into_the_graph(facts):
    """What the double refuses at capture: on a GPU the graph replays the capture's value (2), not the host's (3)."""
    assert observed(facts, "host_scalar_frozen")["replayed"] == [2.0] * 4


def test_an_event_recorded_in_a_capture_stays_inside_it(facts):
    seen = observed(facts, "captured_event")
    for what in ("query", "synchronize", "wait"):
        assert seen[what] is not None and "captur" in seen[what].lower(), (what, seen[what])


def test_a_non_capturable_optimizer_refuses_a_step_in_a_capture(facts):
    error = observed(facts, "optimizer_capturable")["error"]
    assert error is not None and "graph capture of step() for an instance of Adam" in error, error
    assert "capturable is False" in error


def test_a_capturing_stream_cannot_wait_on_an_event_recorded_outside():
    gpus_or_skip(1)
    error = observed(run_facts("capture_isolation"), "capture_isolation")["error"]
    assert error is not None and "uncaptured work in another stream" in error, error


def test_a_fork_not_joined_back_fails_the_end_of_the_capture():
    gpus_or_skip(1)
    error = observed(run_facts("fork_not_joined"), "fork_not_joined")["error"]
    assert error is not None and "not joined" in error, error
