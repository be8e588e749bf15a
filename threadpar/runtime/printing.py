"""Readable printing from rank threads: once (rank 0), or every rank with a prefix, never interleaved."""

from __future__ import annotations

import builtins
import threading
from typing import Any

from threadpar.runtime.context import current, in_rank

_print_lock = threading.Lock()


def rank_print(*args: Any, **kwargs: Any) -> None:
    """print() with a "[rank r]" prefix (no prefix outside a rank thread); lines never interleave."""
    prefix = f"[rank {current().rank}]" if in_rank() else None
    kwargs.setdefault("flush", True)
    with _print_lock:
        if prefix is None:
            builtins.print(*args, **kwargs)
        else:
            builtins.print(prefix, *args, **kwargs)


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on global rank 0 only (and outside rank threads)."""
    if not in_rank() or current().rank == 0:
        kwargs.setdefault("flush", True)
        with _print_lock:
            builtins.print(*args, **kwargs)
