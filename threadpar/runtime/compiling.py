"""torch.compile in rank threads: every rank thread starts in a copy of the launching thread's context, in
which dynamo's recompile limits are multiplied by the number of rank threads.

torch 2.13 keeps a user's change to a dynamo (or inductor) config value in a ContextVar
(torch/utils/_config_module.py: "User overrides are thread-local"), and a new thread starts in an empty
context, so a rank thread would not see what the launching script set. Running each rank in a copy of the
launching thread's context passes those settings on (free-threaded CPython 3.14 does this for every new
thread: sys.flags.thread_inherit_context).

The limits: dynamo keeps the compiled variants of a code object in one cache shared by every thread, and
after `recompile_limit` (8) variants it runs that code eagerly from then on, saying so once in a warning.
Rank threads each add variants: pipeline stages compile different graphs, and ranks that miss the cache at
the same time each compile (the cache is checked before dynamo's compile lock is taken), so with more than
8 ranks some would silently train eagerly. Raising the limits n-fold for the ranks gives each rank what one
process of its own would have; compiling once and sharing is what the cache already does when the guards of
a variant pass for another rank. Nothing else changes: the launching thread keeps its limits.

Collectives in compiled code: dynamo must not trace threadpar's communication code (a leader thread of a
rendezvous would run inside a frame dynamo is compiling, meeting other ranks' real tensors as fake ones,
and locks cannot be traced). `keep_dynamo_out_of_comm` puts the threadpar.comm package on dynamo's skip
list (torch._dynamo.trace_rules.add, how dynamo skips third-party packages): compiled code that calls a
collective breaks its graph there and runs the collective as plain Python, as torch.compile does with
any code it skips.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from typing import Any

# Process-wide: dynamo's skip list is. Guards _comm_skipped (DESIGN.md's table).
_SKIP_LOCK = threading.Lock()
_comm_skipped = False


def rank_thread_contexts(n: int) -> list[contextvars.Context]:
    """One context per rank thread of this process, each a copy of the calling thread's, with dynamo's
    limits raised n-fold when torch._dynamo is loaded (torch.compile loads it; a launch whose ranks call
    torch.compile should import torch._dynamo first, as the demo's --compile does)."""
    base = contextvars.copy_context()
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        keep_dynamo_out_of_comm()
        if n > 1:
            base.run(_raise_limits, config, n)
    return [base.copy() for _ in range(n)]


def keep_dynamo_out_of_comm() -> None:
    """Put threadpar.comm on dynamo's skip list, once per process (loads torch._dynamo: call it only when
    compiling)."""
    global _comm_skipped
    with _SKIP_LOCK:
        if not _comm_skipped:
            import torch._dynamo.trace_rules

            torch._dynamo.trace_rules.add("threadpar.comm")
            _comm_skipped = True


def _raise_limits(config: Any, n: int) -> None:
    # Set inside `base.run`, so the change is in that context only (a ContextVar set).
    config.recompile_limit = config.recompile_limit * n
    config.accumulated_recompile_limit = config.accumulated_recompile_limit * n
