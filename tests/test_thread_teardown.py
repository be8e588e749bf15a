"""When a launch returns, every thread it started has ended, its teardown included.

A thread's teardown drops what it held (its target and arguments, its thread-locals). Left running past
the launch, a thread may drop the last reference to a torch object whose destructor releases the GIL (a
gloo group, a store client) during interpreter exit, which aborts the process: "terminate called without
an active exception" (pytorch/pytorch#38228, CPython gh-87135). A process of 2 x 2 ranks did so after
printing "finished" in 1 run of 4 of the fault tests (the message pump ended after the launch returned).

Each test slows the teardown of the threads it watches with a thread-local whose destructor sleeps; a
launch that did not wait for the teardown returns before those destructors have finished.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import threadpar
from threadpar.comm.hierarchical.connect import Connecting
from threadpar.comm.hierarchical.router import MessageRouter
from threadpar.runtime.peer_processes import Processes
from threadpar.testing import run_processes


class _SlowTeardown:
    """Lives in one thread's thread-local; its destructor (the thread's teardown) sleeps, then records."""

    def __init__(self, name: str, seconds: float, ended: list[str], lock: threading.Lock) -> None:
        self.name, self.seconds, self.ended, self.lock = name, seconds, ended, lock

    def __del__(self) -> None:
        time.sleep(self.seconds)
        with self.lock:
            self.ended.append(self.name)


class Teardowns:
    """Slows the teardown of the threads it is called on by `seconds` each, and tells which have ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.ended: list[str] = []
        self._local = threading.local()

    def slow_this_thread(self) -> None:
        name = threading.current_thread().name
        with self.lock:
            self.started.append(name)
        self._local.probe = _SlowTeardown(name, self.seconds, self.ended, self.lock)

    def slowed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` (a thread's target), slowing the teardown of the thread that runs it."""

        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.slow_this_thread()
            return method(*args, **kwargs)

        return run

    def unfinished(self) -> list[str]:
        """The watched threads whose teardown has not finished yet."""
        with self.lock:
            return sorted((Counter(self.started) - Counter(self.ended)).elements())


def test_a_launch_returns_after_its_rank_threads_have_ended():
    teardowns = Teardowns(0.3)
    threadpar.launch(teardowns.slow_this_thread, world_size=2, devices="cpu")
    assert sorted(teardowns.started) == ["threadpar-rank-0", "threadpar-rank-1"]
    assert teardowns.unfinished() == []


def test_a_process_launch_returns_after_its_pump_watcher_and_gloo_connectors_have_ended(monkeypatch):
    teardowns = Teardowns(1.5)  # longer than the 1 s the watcher was once given
    for cls, name in ((MessageRouter, "_receive_all"), (Processes, "_watch"), (Connecting, "_run")):
        monkeypatch.setattr(cls, name, teardowns.slowed(getattr(cls, name)))

    def step() -> torch.Tensor:
        x = torch.full((4,), float(threadpar.get_rank() + 1))
        threadpar.all_reduce(x)  # across the processes: connects the world group's gloo group
        return x

    results = run_processes(step, 2, 2, devices="cpu")
    unfinished = teardowns.unfinished()  # now: later, the slowed teardowns would have finished anyway
    expected = torch.full((4,), 10.0)
    for result in (r for process in results for r in process):
        torch.testing.assert_close(result, expected)
    kinds = Counter(name.rsplit("-", 1)[0] for name in teardowns.started)  # threadpar-pump-p0: threadpar-pump
    assert kinds["threadpar-pump"] == 2 and kinds["threadpar-watch"] == 2, kinds
    assert kinds["threadpar-gloo-connect"] >= 2, kinds
    assert unfinished == []
