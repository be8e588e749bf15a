"""torch's process-per-rank test suites on rank threads: `pytest -p threadpar.testing.process_tests`.

Every `MultiProcessTestCase` and `MultiProcContinuousTest` subclass (torch/testing/_internal/
common_distributed.py: DTensorTestBase, FSDPTest, DistributedTestBase, ...) runs each test's ranks as rank
threads of the test process, on threadpar's c10d backend, instead of one spawned process per rank. What
torch's harness does in each spawned process, each rank thread does (`MultiProcessTestCase._run` /
`run_test`, `MultiProcContinuousTest._worker_loop`): a fresh instance of the test class with `rank` and
`file_name` set, `set_rng_seed()`, the test method, torch's exit codes for a skip (`TEST_SKIPS`, SkipTest:
"generic"), an error (`TEST_ERROR_EXIT_CODE` with the traceback) or `sys.exit`, and `destroy_process_group`
after it; the outcome is then judged by torch's own `_check_return_codes`, so skips, expected failures and
a failing rank are reported as torch's harness reports them. A rank that fails stops the others at once
(the launch's stop); a test that runs past torch's `get_timeout(test id)` is stopped with every rank
thread's stack printed.

Each rank starts as a fresh process would: torch.distributed not initialised (its `init_process_group`,
with any backend, `file://`/`tcp://`/`env://` init method or store, makes the rank's default group on the
`threadpar` backend of the launch), torchrun's variables, its own seeds (runtime/rank_process). Each rank
runs an instance of a per-rank subclass of the test class, so what a test or harness stores on its class
(`cls.rank`, `cls.pg` in MultiProcContinuousTest) stays that rank's. Every test is one launch: it leaves no
thread, group or store file behind.

What cannot run on threads is skipped with the reason: a test that expects its process to be killed by a
signal (`special_return_code_checks` with a negative code: the rank threads share one process).

Enable it per run (`pytest -p threadpar.testing.process_tests`), per project (`addopts = "-p
threadpar.testing.process_tests"` in pytest's configuration; `pytest_plugins = ["threadpar.testing.
process_tests"]` in a root conftest.py), or without pytest: `install()` before a unittest run, or `python -m
threadpar.testing.process_tests test_module ...` (unittest's command line).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import threading
import time
import traceback
import types
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from threadpar.errors import RankAborted, RankFailedError
from threadpar.runtime.context import current
from threadpar.runtime.launch import launch
from threadpar.runtime.rank_exit import ProcessExit, exit_code

# torch's harness, imported on install (it imports torch's test utilities, which need `expecttest`).
_torch: dict[str, Any] = {}
_patched: list[tuple[type, str, Any]] = []
_install_lock = threading.Lock()
TERMINATED = -15  # what torch's harness sees of the processes it terminates after another failed
COLLECTIVE_MARGIN_S = 30.0  # a collective's wait is the test's timeout and this


def _harness() -> Any:
    try:
        from torch.testing._internal import common_distributed, common_utils
    except ImportError as missing:
        raise ImportError(
            f"threadpar.testing.process_tests runs torch's distributed test harness "
            f"(torch.testing._internal.common_distributed), which could not be imported: {missing}. torch's "
            "test utilities need `expecttest`: pip install expecttest"
        ) from missing
    _torch["cd"], _torch["utils"] = common_distributed, common_utils
    return common_distributed


def install() -> None:
    """Run torch's MultiProcessTestCase / MultiProcContinuousTest subclasses on rank threads from now on
    (idempotent; `uninstall` restores torch's harness)."""
    with _install_lock:
        if _patched:
            return
        cd = _harness()
        patches: dict[type, dict[str, Any]] = {
            cd.MultiProcessTestCase: {
                "_spawn_processes": _spawn_processes,
                "_start_processes": _start_processes,
                "_join_processes": _join_processes,
            },
            cd.MultiProcContinuousTest: {
                "_ensure_processes_spawned": classmethod(_ensure_processes_spawned),
                "tearDownClass": classmethod(_tear_down_class),
                "_worker_run_main_wait": _worker_run_main_wait,
            },
        }
        for cls, methods in patches.items():
            for name, replacement in methods.items():
                _patched.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, replacement)


def uninstall() -> None:
    with _install_lock:
        while _patched:
            cls, name, original = _patched.pop()
            setattr(cls, name, original)


# pytest's hooks: `-p threadpar.testing.process_tests` loads this module as a plugin.
def pytest_configure(config: Any) -> None:
    install()


def pytest_unconfigure(config: Any) -> None:
    uninstall()


# ---------------------------------------------------------------------------------------------------------
# MultiProcessTestCase


def _spawn_processes(self: Any) -> None:
    """Replaces torch's: no start method to set, no process to spawn (the ranks start in _join_processes)."""
    self._start_processes(None)


def _start_processes(self: Any, proc: Any) -> None:
    self.processes = []
    self._threadpar_ranks = True


@dataclass
class _RankProcess:
    """What torch's `_check_return_codes` reads of a process, for one rank thread."""

    rank: int
    exitcode: int | None

    @property
    def pid(self) -> str:
        return f"rank thread {self.rank}"

    def terminate(self) -> None:
        """torch's tearDown terminates its processes; a rank thread has ended by then (the launch joined it)."""


@dataclass
class _Pipe:
    """The pipe torch's harness reads a failed process's traceback from."""

    text: str

    def recv(self) -> str:
        return self.text

    def close(self) -> None:
        pass


@dataclass
class _Outcome:
    exitcode: int | None = None  # None: did not end (stopped after another rank failed, or timed out)
    text: str = ""


class _RankFailed(Exception):
    """Raised out of a rank after its test failed, so that the launch stops the other ranks at once."""


def _join_processes(self: Any, fn: Callable[..., Any]) -> None:
    """Replaces torch's: run the test's ranks on threads, then judge them with torch's `_check_return_codes`."""
    if not getattr(self, "_threadpar_ranks", False):
        return _torch_join_processes(self, fn)
    signal = _expected_signal(self, fn)
    if signal is not None:
        raise unittest.SkipTest(
            f"{self.id()} expects its process to be killed by signal {signal} (special_return_code_checks); "
            "threadpar.testing.process_tests runs the ranks as threads of one process, which cannot die alone"
        )
    cd = _torch["cd"]
    timeout = cd.get_timeout(self.id())
    test_name = self._current_test_name()
    test_class = type(self)
    file_name = self.file_name

    def rank_main() -> None:
        rank = current().rank
        instance = _per_rank_class(test_class)(test_name)
        instance.rank = rank
        instance.file_name = file_name
        _run_test(instance, test_name, outcomes)

    outcomes = [_Outcome() for _ in range(self.world_size)]
    start = time.monotonic()
    _launch_ranks(rank_main, self.world_size, timeout, self.id(), outcomes)
    elapsed = time.monotonic() - start
    self.processes = [_RankProcess(rank, o.exitcode) for rank, o in enumerate(outcomes)]
    self.pid_to_pipe = {p.pid: _Pipe(o.text) for p, o in zip(self.processes, outcomes)}
    try:
        self._check_return_codes(fn, elapsed)
    finally:
        _remove(file_name)


def _torch_join_processes(self: Any, fn: Callable[..., Any]) -> None:
    for _cls, name, original in _patched:
        if name == "_join_processes":
            return original(self, fn)
    raise RuntimeError("threadpar.testing.process_tests is not installed")


def _expected_signal(self: Any, fn: Callable[..., Any]) -> int | None:
    code = getattr(self, "special_return_code_checks", {}).get(fn)
    return -code if isinstance(code, int) and code < 0 else None


def _run_test(self: Any, test_name: str, outcomes: list[_Outcome]) -> None:
    """One rank's part of torch's `MultiProcessTestCase.run_test`, with the exit code it would have."""
    cd, utils = _torch["cd"], _torch["utils"]
    outcome = outcomes[self.rank]
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"  # (as run_test: one value for every rank)
    utils.set_rng_seed()
    try:
        getattr(self, test_name)()
    except unittest.SkipTest:
        outcome.exitcode = cd.TEST_SKIPS["generic"].exit_code
        return
    except (SystemExit, ProcessExit) as ending:
        outcome.exitcode = exit_code(ending)[0]
        return
    except RankAborted:
        if current().world.abort.is_set:
            raise  # stopped because another rank failed: not this rank's outcome
        outcome.exitcode, outcome.text = cd.MultiProcessTestCase.TEST_ERROR_EXIT_CODE, traceback.format_exc()
        raise _RankFailed() from None
    except Exception:
        outcome.exitcode, outcome.text = cd.MultiProcessTestCase.TEST_ERROR_EXIT_CODE, traceback.format_exc()
        raise _RankFailed() from None
    if self.destroy_pg_upon_exit:
        with contextlib.suppress(AssertionError, ValueError):
            torch.distributed.destroy_process_group()
    outcome.exitcode = 0


def _launch_ranks(
    rank_main: Callable[[], None], world_size: int, timeout: float, test_id: str, outcomes: list[_Outcome]
) -> None:
    """One launch of `world_size` rank threads, each starting as a fresh process (torch.distributed not
    initialised); stopped with every rank's stack printed if it runs past `timeout` seconds."""
    aborts: list[Any] = []
    timed_out = threading.Event()

    def fresh_process_rank() -> None:
        if not aborts:
            aborts.append(current().world.abort)
        torch.distributed.destroy_process_group()  # the launch initialised it; a fresh process has not
        rank_main()

    def stop() -> None:
        timed_out.set()
        print(_stacks(f"{test_id} timed out after {timeout} s; where each rank thread was:"), file=sys.stderr)
        if aborts:
            aborts[0].trigger(f"{test_id} timed out after {timeout} s (torch's get_timeout)")

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    try:
        # The test's own timeout governs, as in torch's harness: a collective's wait (the launch's timeout, which
        # names the ranks that did not come) is longer, so that a hang is reported as torch reports it.
        launch(fresh_process_rank, **_placement(world_size), timeout=float(timeout) + COLLECTIVE_MARGIN_S)
    except RankFailedError as failed:
        if not isinstance(failed.error, _RankFailed) and outcomes[failed.rank].exitcode is None:
            # A failure outside the test body (the launch, the rank's start): reported as the rank's error.
            outcomes[failed.rank].exitcode = _torch["cd"].MultiProcessTestCase.TEST_ERROR_EXIT_CODE
            outcomes[failed.rank].text = failed.traceback_text
    finally:
        timer.cancel()
        timer.join()
    if not timed_out.is_set():
        for outcome in outcomes:
            if outcome.exitcode is None:  # stopped because another rank failed, as torch terminates them
                outcome.exitcode = TERMINATED


def _placement(world_size: int) -> dict[str, Any]:
    """A rank per GPU when there are enough GPUs (torch's tests on `nccl`), else CPU threads."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return {"world_size": world_size}
    return {"world_size": world_size, "devices": "cpu", "backend": "threads"}


def _stacks(title: str) -> str:
    frames = sys._current_frames()
    lines = [title]
    for thread in threading.enumerate():
        if thread.name.startswith("threadpar-rank-") and thread.ident in frames:
            lines.append(f"--- {thread.name} ---")
            lines.append("".join(traceback.format_stack(frames[thread.ident])).rstrip())
    return "\n".join(lines)


def _remove(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.remove(path)


# ---------------------------------------------------------------------------------------------------------
# MultiProcContinuousTest


def _ensure_processes_spawned(cls: Any) -> None:
    """Replaces torch's: decide the world size and check the backend as torch does, spawn nothing (each
    test is one launch of rank threads, and a new group of the launch is made in microseconds)."""
    if cls._processes_spawned:
        return
    device_type_attr: Any = cls.__dict__.get("device_type", cls.device_type)
    if isinstance(device_type_attr, classmethod):
        device_type = device_type_attr.__func__(cls)
    elif isinstance(device_type_attr, property) and device_type_attr.fget is not None:
        device_type = device_type_attr.fget(cls)  # as torch's: DTensorTestMixin's reads class attributes only
    elif callable(device_type_attr):
        device_type = device_type_attr()
    else:
        device_type = device_type_attr
    cls.world_size = cls._get_world_size(device_type)
    cls.processes, cls.task_queues, cls.completion_queues = [], [], []
    cls._processes_spawned = True


def _tear_down_class(cls: Any) -> None:
    cls._processes_spawned = False
    unittest.TestCase.tearDownClass.__func__(cls)  # type: ignore[attr-defined]


def _worker_run_main_wait(self: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces torch's: the dispatcher's side runs the test's ranks on threads."""

    @functools.wraps(fn)
    def wrapper(self: Any) -> None:
        if self.rank == self.MAIN_PROCESS_RANK:
            _run_continuous(self)
        else:
            fn()

    return types.MethodType(wrapper, self)


def _run_continuous(self: Any) -> None:
    """What torch's worker loop does for one test in each rank (init, run, destroy), then what its
    dispatcher does with the results: the first skip or failure is raised. Unlike torch's, a failure does not
    skip the class's later tests ("Previous test failed"): each test is a launch of its own here, so one
    cannot leave the next a broken group."""
    cd = _torch["cd"]
    cls = type(self)
    world_size = cls.world_size
    test_id = self.id()
    results: list[BaseException | None] = [None] * world_size
    outcomes = [_Outcome() for _ in range(world_size)]
    fd, rdvz_file = tempfile.mkstemp(prefix="threadpar-rdvz-")
    os.close(fd)

    def rank_main() -> None:
        rank = current().rank
        rank_class = _per_rank_class(cls)
        rank_class.rank, rank_class.world_size = rank, world_size
        try:
            rank_class._init_pg(rank, world_size, rdvz_file)
        except SystemExit as ending:
            skip = _skip_of(exit_code(ending)[0])
            if skip is None:
                raise
            results[rank] = unittest.SkipTest(skip)
            outcomes[rank].exitcode = 0
            return
        try:
            rank_class._run_test_given_id(test_id)
        except BaseException as error:
            if isinstance(error, RankAborted) and current().world.abort.is_set:
                raise
            skip = _skip_of(exit_code(error)[0]) if isinstance(error, (SystemExit, ProcessExit)) else None
            if skip is not None:
                results[rank] = unittest.SkipTest(skip)
                outcomes[rank].exitcode = 0
                return
            text = traceback.format_exc()
            enhanced = RuntimeError(f"Exception in worker process:\n{text}")
            enhanced.__cause__ = error
            results[rank] = enhanced
            outcomes[rank].exitcode = cd.MultiProcessTestCase.TEST_ERROR_EXIT_CODE
            raise _RankFailed() from None
        torch.distributed.destroy_process_group()
        outcomes[rank].exitcode = 0

    try:
        _launch_ranks(rank_main, world_size, cd.get_timeout(test_id), test_id, outcomes)
    finally:
        _remove(rdvz_file)
    for rank, result in enumerate(results):
        if isinstance(result, unittest.SkipTest):
            raise result
        if isinstance(result, BaseException):
            raise result
        if outcomes[rank].exitcode is None:
            raise RuntimeError(f"Rank {rank} of {test_id} timed out after {cd.get_timeout(test_id)} s")


def _per_rank_class(cls: type) -> Any:
    """A subclass of `cls` for one rank: what the harness and tests set on their class (cls.rank, cls.pg)
    stays this rank's, as each spawned process has its own class."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _skip_of(code: int) -> str | None:
    for skip in _torch["cd"].TEST_SKIPS.values():
        if skip.exit_code == code:
            return str(skip.message)
    return None


def main() -> None:
    """`python -m threadpar.testing.process_tests [unittest arguments]`: unittest's command line with torch's
    multi-process test cases on rank threads."""
    install()
    unittest.main(module=None)


if __name__ == "__main__":
    main()
