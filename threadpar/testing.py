"""Helpers for regression tests of parallel code: run a test body on N rank threads, in milliseconds.

    from threadpar.testing import on_ranks

    @on_ranks(4, tp=2)
    def test_tp_all_reduce():
        t = torch.ones(3)
        threadpar.all_reduce(t, group="TP")
        assert (t == 2).all()

The body runs on every rank (CPU threads, `threads` backend). The first rank to fail stops the others, and
its own exception is re-raised with "on rank r" added, so pytest shows the failing assertion as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from threadpar.errors import RankFailedError
from threadpar.runtime.launch import launch

F = TypeVar("F", bound=Callable[..., Any])

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


def on_ranks(world_size: int | None = None, **launch_kwargs: Any) -> Callable[[F], F]:
    """Decorator: run the decorated test on `world_size` rank threads (pytest fixtures still work)."""

    def decorate(test: F) -> F:
        @functools.wraps(test)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_ranks(functools.partial(test, *args, **kwargs), world_size, **launch_kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
