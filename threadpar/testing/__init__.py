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
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec

from threadpar.errors import RankFailedError, RemoteRankError
from threadpar.runtime.launch import launch, launch_in_process, resolve_config
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv

P = ParamSpec("P")  # the decorated test's parameters (pytest fixtures), kept by on_ranks

# Short enough that a deadlock in a test fails fast; long enough for a loaded 2-core CI machine.
TEST_TIMEOUT_S = 20.0


# What a test launch uses unless told otherwise: CPU threads, and a timeout that fails a deadlock fast.
TEST_CONFIG = LaunchConfig(devices="cpu", backend="threads", timeout=TEST_TIMEOUT_S)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int | None = None,
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    config: LaunchConfig = TEST_CONFIG,
    **options: Any,
) -> list[Any]:
    """`launch(fn, *args, kwargs=kwargs, config=config, world_size=..., **options)` on CPU threads (the
    `TEST_CONFIG` defaults); re-raise a rank's own exception."""
    if world_size is not None:
        options["world_size"] = world_size
    try:
        return launch(fn, *args, kwargs=kwargs, config=config, **options)
    except RankFailedError as failed:
        error = failed.error
        if hasattr(error, "add_note"):
            error.add_note(f"(raised on rank {failed.rank}; the traceback above is that rank's)")
        raise error from None


def on_ranks(
    world_size: int | None = None, **options: Any
) -> Callable[[Callable[P, Any]], Callable[P, None]]:
    """Decorator: run the decorated test on `world_size` rank threads (pytest fixtures still work)."""

    def decorate(test: Callable[P, Any]) -> Callable[P, None]:
        @functools.wraps(test)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
            run_ranks(functools.partial(test, *args, **kwargs), world_size, **options)

        return wrapper

    return decorate


def launch_processes(
    fn: Callable[..., Any],
    processes: int,
    threads_per_process: int,
    *args: Any,
    per_process: Callable[[int], Mapping[str, Any]] | None = None,
    store: Any = None,
    kwargs: Mapping[str, Any] | None = None,
    config: LaunchConfig = TEST_CONFIG,
    **options: Any,
) -> list[Any]:
    """Launch `fn(*args, **kwargs)` as `processes` simulated processes x `threads_per_process` rank threads
    in this interpreter, sharing a store (a new HashStore unless given) as torchrun's processes share a
    TCPStore. Returns, per process, its list of per-thread results or the exception its launch raised.
    `per_process(p)` may replace launch options for process p."""
    import torch.distributed as dist

    config = resolve_config(config, {**options, "threads_per_process": threads_per_process})
    store = dist.HashStore() if store is None else store
    outcomes: list[Any] = [None] * processes

    def process_main(p: int) -> None:
        try:
            own = config.with_options(per_process(p)) if per_process else config
            env = ProcessEnv(p, processes, store=store)
            outcomes[p] = launch_in_process(env, fn, args, dict(kwargs or {}), own)
        except BaseException as error:
            outcomes[p] = error

    threads = [threading.Thread(target=process_main, args=(p,), daemon=True) for p in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def run_processes(
    fn: Callable[..., Any], processes: int, threads_per_process: int, *args: Any, **options: Any
) -> list[list[Any]]:
    """`launch_processes`, re-raising the root-cause rank's own exception (as run_ranks does); returns
    each process's per-thread results."""
    outcomes = launch_processes(fn, processes, threads_per_process, *args, **options)
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
