"""torch's process-per-rank test cases on rank threads (threadpar/testing/process_tests.py), run by unittest."""

from __future__ import annotations

import io
import os
import threading
import unittest

import pytest

pytest.importorskip("expecttest", reason="torch's test harness (common_distributed) imports expecttest")

import torch.distributed as dist
from helpers import process_cases
from torch.testing._internal import common_distributed

from threadpar.testing import process_tests


@pytest.fixture
def on_threads():
    """The plugin installed for one test, and torch's harness restored after it."""
    spawn = common_distributed.MultiProcessTestCase._spawn_processes
    process_tests.install()
    try:
        yield
    finally:
        process_tests.uninstall()
    assert common_distributed.MultiProcessTestCase._spawn_processes is spawn


def _run(case: type, *names: str) -> unittest.TestResult:
    suite = unittest.TestSuite(case(name) for name in names)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    return result


def test_a_passing_test_runs_each_rank_as_a_fresh_process(on_threads):
    threads = {t.ident for t in threading.enumerate()}
    result = _run(process_cases.TwoRanks, "test_all_reduce_and_rank_state")
    assert result.wasSuccessful(), [text for _, text in result.failures + result.errors]
    # Each rank ran an instance of a class of its own (what a test sets on its class stays the rank's).
    classes = [process_cases.PROBE[f"class {r}"] for r in (0, 1)]
    assert classes[0] is not classes[1] and all(issubclass(c, process_cases.TwoRanks) for c in classes)
    # Per-test isolation: no thread, no default group, no store file left behind.
    assert {t.ident for t in threading.enumerate()} <= threads
    assert not dist.is_initialized()
    assert not os.path.exists(process_cases.PROBE["file 0"])


def test_a_failing_rank_is_reported_as_torchs_harness_reports_it(on_threads):
    result = _run(process_cases.TwoRanks, "test_fails_on_rank_1")
    assert len(result.failures + result.errors) == 1
    text = (result.failures + result.errors)[0][1]
    assert "Process 1 exited with error code 10 and exception" in text and "boom on rank 1" in text


def test_skips_and_expected_failures_follow_torchs_conventions(on_threads):
    result = _run(
        process_cases.TwoRanks,
        "test_expected_failure",
        "test_needs_two_gpus",
        "test_exit_code_skip",
        "test_killed_by_a_signal",
    )
    assert len(result.expectedFailures) == 1 and not result.failures and not result.errors
    reasons = dict((test._testMethodName, why) for test, why in result.skipped)
    assert reasons["test_needs_two_gpus"] == "Need at least 2 CUDA devices"
    assert reasons["test_exit_code_skip"] == "Skipped due to small world size."
    assert (
        "killed by signal 6" in reasons["test_killed_by_a_signal"]
        and "threads of one process" in reasons["test_killed_by_a_signal"]
    )


def test_a_test_past_its_timeout_is_stopped_and_named(on_threads, monkeypatch):
    monkeypatch.setitem(common_distributed.TIMEOUT_OVERRIDE, "test_hangs_on_rank_1", 2)
    result = _run(process_cases.TwoRanks, "test_hangs_on_rank_1")
    assert len(result.failures + result.errors) == 1
    assert "terminated or timed out" in (result.failures + result.errors)[0][1]
    assert not [t for t in threading.enumerate() if t.name.startswith("threadpar-rank-")]


def test_continuous_tests_run_per_test_with_the_class_state_per_rank(on_threads):
    result = _run(process_cases.ContinuousRanks, "test_a_fails", "test_b_group_per_rank")
    assert (
        len(result.failures + result.errors) == 1
        and "failing on rank" in (result.failures + result.errors)[0][1]
    )
    assert result.testsRun == 2 and not result.skipped  # the failure did not skip the next test
    assert [process_cases.PROBE[f"continuous {r}"] for r in (0, 1)] == ["0", "1"]


def test_a_dtensor_test_base_case_draws_as_processes_do(on_threads):
    result = _run(process_cases.DTensorCase, "test_distribute_and_gather")
    assert result.wasSuccessful(), [text for _, text in result.failures + result.errors]
