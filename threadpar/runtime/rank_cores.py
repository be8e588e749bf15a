"""Which CPU cores a process's rank threads run on (`LaunchConfig.rank_cores`).

The rank threads of one process share one GIL: only one of them runs Python at a time, whatever the
number of cores. Every torch op releases the GIL while it runs; spread over several cores, a thread
waiting for the GIL on another core wakes up at each release, takes the GIL, and the thread whose op just
finished must sleep until it comes back: a futex wake and a context switch per op (a "convoy", the
multi-core GIL effect David Beazley measured in 2010). Packed onto one core, the waiters cannot run
while the holder's op runs, so the holder takes the GIL back at once and hand-offs happen only at the
interpreter's switch interval. Measured on this project's 2-core machine: 8 threads doing 64-element ops
ran 2.9x faster on one core than on two, the demo's tiny GPT 1.17x (`python -m benchmarks.rank_cores`), a
collective's host cost about halved (`benchmarks.nccl_launch`); but a model whose ops are long (GPT
'medium' on CPU) ran 0.64x, since its math, which runs without the GIL, then has one core instead of two.

The setting:
- None ("auto", the default): on CPU, a process that runs two or more rank threads packs them onto one
  core (the ranks are CPU stand-ins for GPUs, used for tests, notebooks and the demo: small ops); CUDA
  ranks stay where the OS puts them (unmeasured on a GPU, and CUDA's default spin-wait while a sync
  waits would take the shared core from the other ranks' Python); and without a GIL (free-threaded
  CPython with the GIL off: `sys._is_gil_enabled()`) nothing is packed, since there is no convoy to
  avoid and the ranks' Python runs in parallel (`python -m benchmarks.free_threading --demo`);
- "all": every core the process may use (no pinning): for CPU ranks that do heavy math;
- an int k: the rank threads share k cores.

Under torchrun, process l of a node takes the cores after process l-1's, so the processes of a node do
not share cores; a lone process takes the core its launching thread is running on (two independent jobs
on one machine then rarely land on the same core). Only the rank threads and their comm workers are
pinned (threads they start inherit it); the launching thread is left as it was.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from threadpar.errors import ConfigError

ALL = "all"
RankCores = int | str | None


def check_rank_cores(value: object) -> None:
    """Raise ConfigError unless `value` is None, "all" or a positive int (LaunchConfig's check)."""
    if value is None or value == ALL:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    raise ConfigError(
        f"rank_cores must be a positive int (the cores this process's rank threads share), 'all' (no "
        f"pinning) or None (one core for CPU ranks, no pinning for GPUs); got {value!r}"
    )


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def allowed_cpus() -> list[int]:
    """The cores the calling thread may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def gil_enabled() -> bool:
    """Whether this interpreter runs Python one thread at a time: always on a GIL build; on a free-threaded
    build unless a module that needs the GIL switched it back on (or PYTHON_GIL=1)."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)  # CPython 3.13+
    return True if is_enabled is None else bool(is_enabled())


def current_cpu() -> int | None:
    """The core the calling thread is running on now (Linux: /proc/thread-self/stat, field 39), or None."""
    try:
        with open("/proc/thread-self/stat", encoding="ascii") as f:
            # The command name (field 2) is in parentheses and may hold spaces: count fields after it.
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 of the whole line
    except (OSError, IndexError, ValueError):
        return None


def choose_rank_cpus(
    setting: RankCores,
    *,
    on_cpu: bool,
    threads: int,
    local_index: int,
    local_count: int,
    allowed: Sequence[int],
    current: int | None = None,
) -> frozenset[int] | None:
    """The cores for the rank threads of process `local_index` of `local_count` on this node, or None to
    leave them unpinned. `allowed`: the cores the process may use; `current`: the launching thread's core
    (where a lone process packs its ranks)."""
    if setting == ALL:
        return None
    if setting is None:
        if not on_cpu or threads < 2 or not can_pin() or not gil_enabled():
            return None
        k = 1
    else:
        assert isinstance(setting, int)
        if not can_pin():
            raise ConfigError(
                f"rank_cores={setting}: this platform cannot pin threads to cores (os.sched_setaffinity is "
                "Linux-only); leave rank_cores out"
            )
        k = setting
        share = len(allowed) // max(1, local_count)
        if k > share:
            where = (
                f" ({len(allowed)} cores for {local_count} processes on this node)" if local_count > 1 else ""
            )
            raise ConfigError(
                f"rank_cores={k} but this process may use {share} core(s){where}; pass at most {share}, or "
                "'all' to leave the rank threads unpinned"
            )
    if k >= len(allowed):
        return None  # every allowed core: nothing to pin
    if local_count == 1 and current is not None and current in allowed:
        start = list(allowed).index(current)
    else:
        start = local_index * k
    return frozenset(allowed[(start + j) % len(allowed)] for j in range(k))


def pin_calling_thread(cpus: frozenset[int] | None) -> None:
    """Run the calling thread on `cpus` from now on (None: leave it as it is)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
