"""Helpers for regression tests of parallel code: run a test body on N rank threads, in milliseconds.

    from threadpar.testing import on_ranks

    @on_ranks(4, tp=2)
    def test_tp_all_reduce():
        t = torch.ones(3)
        threadpar.all_reduce(t, group="TP")
        assert (t == 2).all()

The body runs on every rank (CPU threads, `threads` backend). The first rank to fail stops the others, and
its own exception is re-raised with "on rank r" added, so pytest shows the failing assertion as usual.

`run_processes` runs a body as several simulated processes of rank threads in this interpreter: the
multi-process code path (store, gloo groups, hierarchical collectives, routed messages) in seconds, without
torchrun.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, ParamSpec

from threadpar.errors import RankFailedError, RemoteRankError
from threadpar.runtime.launch import launch, launch_in_process
from threadpar.runtime.process_env import ProcessEnv

P = ParamSpec("P")  # the decorated test's parameters (pytest fixtures), kept by on_ranks

# Short enough that a deadlock in a test fails fast; long enough for a loaded 2-core CI machine.
TEST_TIMEOUT_S = 20.0


def run_ranks(
    fn: Callable[..., Any], world_size: int | None = None, *args: Any, **launch_kwargs: Any
) -> list[Any]:
    """`launch(fn, *args, world_size=..., devices="cpu", **launch_kwargs)`; re-raise a rank's own exception."""
    launch_kwargs.setdefault("devices", "cpu")
    launch_kwargs.setdefault("backend", "threads")
    launch_kwargs.setdefault("timeout", TEST_TIMEOUT_S)
    try:
        return launch(fn, *args, world_size=world_size, **launch_kwargs)
    except RankFailedError as failed:
        error = failed.error
        if hasattr(error, "add_note"):
            error.add_note(f"(raised on rank {failed.rank}; the traceback above is that rank's)")
        raise error from None


def on_ranks(
    world_size: int | None = None, **launch_kwargs: Any
) -> Callable[[Callable[P, Any]], Callable[P, None]]:
    """Decorator: run the decorated test on `world_size` rank threads (pytest fixtures still work)."""

    def decorate(test: Callable[P, Any]) -> Callable[P, None]:
        @functools.wraps(test)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
            run_ranks(functools.partial(test, *args, **kwargs), world_size, **launch_kwargs)

        return wrapper

    return decorate


_SIMULATED_DEFAULTS = dict(
    world_size=None, devices="cpu", dp=None, tp=1, pp=1, cp=1, backend="threads", timeout=TEST_TIMEOUT_S,
    seed=0, order=None, intraop_threads=None, print_layout=False,
)  # fmt: skip


def launch_processes(
    fn: Callable[..., Any],
    processes: int,
    threads_per_process: int,
    *args: Any,
    per_process: Callable[[int], dict] | None = None,
    store: Any = None,
    **launch_kwargs: Any,
) -> list[Any]:
    """Launch `fn(*args)` as `processes` simulated processes x `threads_per_process` rank threads in this
    interpreter, sharing a store (a new HashStore unless given) as torchrun's processes share a TCPStore.
    Returns, per process, its list of per-thread results or the exception its launch raised.
    `per_process(p)` may override launch options for process p."""
    import torch.distributed as dist

    unknown = sorted(set(launch_kwargs) - set(_SIMULATED_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown launch options {unknown}")
    store = dist.HashStore() if store is None else store
    outcomes: list[Any] = [None] * processes

    def process_main(p: int) -> None:
        options = {**_SIMULATED_DEFAULTS, **launch_kwargs, **(per_process(p) if per_process else {})}
        try:
            env = ProcessEnv(p, processes, store=store)
            outcomes[p] = launch_in_process(
                env, fn, args, {}, threads_per_process=threads_per_process, **options
            )
        except BaseException as error:
            outcomes[p] = error

    threads = [threading.Thread(target=process_main, args=(p,), daemon=True) for p in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def run_processes(
    fn: Callable[..., Any], processes: int, threads_per_process: int, *args: Any, **launch_kwargs: Any
) -> list[list[Any]]:
    """`launch_processes`, re-raising the root-cause rank's own exception (as run_ranks does); returns
    each process's per-thread results."""
    outcomes = launch_processes(fn, processes, threads_per_process, *args, **launch_kwargs)
    raise_root_cause(outcomes)
    return outcomes


def raise_root_cause(outcomes: list[Any]) -> None:
    """If a simulated process's launch raised, re-raise the root-cause rank's own exception (as run_ranks
    does): every process reports the same root cause; raise it from the process where it happened."""
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        own = [e for e in failures if not isinstance(getattr(e, "error", None), RemoteRankError)]
        first = (own or failures)[0]
        if isinstance(first, RankFailedError):
            error = first.error
            if hasattr(error, "add_note"):
                error.add_note(f"(raised on rank {first.rank}; the traceback above is that rank's)")
            raise error from None
        raise first
