"""`launch`: run a function on one thread per rank and collect what each returns.

Failure handling: the first rank to raise triggers the launch's stop signal, which wakes every waiting
rank at once (they raise RankAborted, a consequence that is not reported as a cause). A rank busy in
Python code that does not reach a wait within a grace period gets RankAborted injected asynchronously.
`launch` then raises RankFailedError naming the failing rank, with its traceback, chained to its exception.
Ctrl-C in the calling thread stops every rank the same way and re-raises KeyboardInterrupt.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from threadpar.errors import ConfigError, RankAborted, RankFailedError
from threadpar.runtime.context import RankContext, leave
from threadpar.runtime.devices import resolve_placement, say_once
from threadpar.runtime.world import World
from threadpar.topology import Layout

DEFAULT_TIMEOUT_S = 300.0
# After a failure, how long ranks get to notice the stop signal before one is injected, and then to exit.
ABORT_GRACE_S = 0.75
INJECT_GRACE_S = 0.5


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_intraop_threads(world_size: int, on_cpu: bool) -> int:
    """Divide the cores among the rank threads on CPU; on GPUs ranks need little CPU parallelism."""
    return (
        max(1, available_cores() // world_size) if on_cpu else max(1, min(4, available_cores() // world_size))
    )


@dataclass
class _Failure:
    rank: int
    error: BaseException
    traceback_text: str
    when: float


class _InjectedAbort(RankAborted):
    def __init__(self) -> None:
        super().__init__("stopped: the launch was aborted while this rank was running")


def _inject(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_InjectedAbort)
        )


class _Launch:
    def __init__(self, world: World, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.world = world
        self.fn, self.args, self.kwargs = fn, args, kwargs
        n = world.world_size
        self.results: list[Any] = [None] * n
        self.failures: list[_Failure] = []
        self.contexts = [RankContext(world, r) for r in range(n)]
        self.running = [False] * n  # inside the user's function: only then may an abort be injected
        self.lock = threading.Lock()
        self.finished = 0
        self.all_done = threading.Event()
        self.threads = [
            threading.Thread(target=self._rank_main, args=(r,), name=f"threadpar-rank-{r}", daemon=True)
            for r in range(n)
        ]

    def _rank_main(self, rank: int) -> None:
        ctx = self.contexts[rank]
        try:
            ctx.enter()
            self.running[rank] = True
            try:
                self.results[rank] = self.fn(*self.args, **self.kwargs)
            finally:
                self.running[rank] = False
        except BaseException as error:
            self._record(rank, error)
        finally:
            leave()
            with self.lock:
                self.finished += 1
                if self.finished == len(self.threads):
                    self.all_done.set()

    def _record(self, rank: int, error: BaseException) -> None:
        consequence = isinstance(error, RankAborted) and self.world.abort.is_set
        if not consequence:
            with self.lock:
                self.failures.append(_Failure(rank, error, traceback.format_exc(), time.monotonic()))
            self.world.abort.trigger(f"rank {rank} failed with {type(error).__name__}: {error}")

    def run(self) -> list[Any]:
        saved_threads = torch.get_num_threads()
        try:
            for t in self.threads:
                t.start()
            self._wait()
        finally:
            for ctx in self.contexts:
                ctx.worker.stop()
            torch.set_num_threads(saved_threads)
        if self.failures:
            first = min(self.failures, key=lambda f: f.when)
            others = sorted({f.rank for f in self.failures if f is not first})
            raise RankFailedError(first.rank, first.error, first.traceback_text, others) from first.error
        return self.results

    def _wait(self) -> None:
        try:
            while not self.all_done.wait(0.05):
                if self.world.abort.is_set:
                    self._stop_stragglers()
                    return
        except KeyboardInterrupt:
            self.world.abort.trigger("KeyboardInterrupt in the calling thread")
            self._stop_stragglers()
            raise

    def _stop_stragglers(self) -> None:
        """After a stop: give ranks a moment to exit, inject an abort into those still running Python, and
        stop waiting for any stuck in native code (they are daemon threads and exit with their op)."""
        if self.all_done.wait(ABORT_GRACE_S):
            return
        for rank, thread in enumerate(self.threads):
            if thread.is_alive() and self.running[rank]:
                _inject(thread)
        self.all_done.wait(INJECT_GRACE_S)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int | None = None,
    devices: int | list[int] | str | None = None,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT_S,
    seed: int = 0,
    order: str | None = None,
    intraop_threads: int | None = None,
    print_layout: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on one thread per rank; return the per-rank results indexed by global rank.

    world_size: number of ranks (default: from devices, dp*tp*cp*pp, or the visible GPUs).
    devices: an int (that many devices), a list of CUDA device ids, or "cpu".
    dp, tp, pp, cp: layout sizes; dp defaults to world_size / (tp * cp * pp).
    backend: "auto" (nccl with one GPU per rank, else threads on CPU), "threads" or "nccl".
    timeout: seconds any collective or receive may wait before it fails, naming who did not arrive.
    seed: base seed of the per-rank generators (threadpar.get_generator()).
    order: axis order, outermost first (default "PP-DP-CP-TP": TP ranks adjacent).
    intraop_threads: torch threads per rank (default: the cores divided among the ranks on CPU).
    print_layout: print every rank's coordinates and groups before starting.
    """
    if not callable(fn):
        raise ConfigError(f"launch needs a callable to run on each rank, got {type(fn).__name__}")
    model_size = tp * cp * pp if all(isinstance(v, int) for v in (tp, cp, pp)) else 1
    placement = resolve_placement(world_size, devices, model_size, dp, backend)
    layout = Layout.build(placement.world_size, dp=dp, tp=tp, pp=pp, cp=cp, order=order)
    on_cpu = placement.devices[0].type == "cpu"
    if intraop_threads is None:
        intraop_threads = default_intraop_threads(placement.world_size, on_cpu)
    elif not isinstance(intraop_threads, int) or intraop_threads < 1:
        raise ConfigError(f"intraop_threads must be a positive int, got {intraop_threads!r}")
    if placement.note:
        say_once(placement.note)
    world = World(
        layout=layout,
        backend=placement.backend,
        devices=placement.devices,
        timeout=timeout,
        seed=seed,
        intraop_threads=intraop_threads,
    )
    if print_layout:
        print(layout.overview(), flush=True)
    return _Launch(world, fn, args, kwargs).run()
