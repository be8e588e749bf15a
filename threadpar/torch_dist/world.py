"""A torch.distributed world per rank thread, while the caller's own world stays as it was.

torch.distributed keeps its state in two places, both process-wide: the Python `_World` object
(`distributed_c10d._world`: the default group, the group names and rank maps) and C++'s group registry
(the names `_c10d_functional` ops resolve). While a launch runs, `ThreadRoutedWorld` replaces the Python
`_world`: a rank thread that has a `RankWorld` sees its own, every other thread (the caller's) the original
object, untouched. C++'s registry is made per thread with torch's own switch
(`_set_thread_isolation_mode`, the mechanism torch's threaded test process group uses); the threads that
are not rank threads keep working with their own registry entries only after the switch is turned off,
which happens when the last launch using it ends (the caller is blocked in `launch` meanwhile).

Installing is counted (`Routing`), so nested or concurrent launches share one installation and the last
one out restores exactly what was there.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_local = threading.local()

# torch's switch between one C++ group registry per process and one per thread (not in its type stubs).
_set_thread_isolation_mode = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]


class RankWorld:
    """One rank thread's torch.distributed state: the fields torch's `_World` exposes, held per thread."""

    def __init__(self) -> None:
        self.default_pg: Any = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = 0
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []

    @property
    def pg_config_info(self) -> list[dict[str, Any]]:
        return c10d._World.pg_config_info.fget(self)  # type: ignore[attr-defined]


def bind(world: RankWorld | None) -> None:
    """Make `world` the calling thread's torch.distributed world (None: the process's again)."""
    _local.world = world


def bound() -> RankWorld | None:
    return getattr(_local, "world", None)


class ThreadRoutedWorld:
    """Stands in for `distributed_c10d._world`: each attribute is the calling rank thread's, or the
    original's in any other thread."""

    __slots__ = ("_original",)

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)

    def _target(self) -> Any:
        world = getattr(_local, "world", None)
        return self._original if world is None else world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


class Routing:
    """The counted installation of the per-thread world (one per process; guarded by `_lock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original: Any = None
        self._patched: list[tuple[Any, str, Any]] = []  # (module, name, original) restored on uninstall

    def install(self, patches: dict[str, Any]) -> None:
        """`patches`: torch.distributed functions to replace while installed (init/destroy_process_group)."""
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            self._original = c10d._world
            c10d._world = ThreadRoutedWorld(self._original)  # type: ignore[assignment]
            _set_thread_isolation_mode(True)
            for name, replacement in patches.items():
                for module in (dist, c10d):
                    self._patched.append((module, name, getattr(module, name)))
                    setattr(module, name, replacement)

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            for module, name, original in reversed(self._patched):
                setattr(module, name, original)
            self._patched.clear()
            _set_thread_isolation_mode(False)
            c10d._world = self._original
            # c10d's _update_default_pg sets this process-wide number on every default group change: give
            # the caller's world its own back.
            pg = self._original.default_pg
            rank = pg.rank() if pg is not None and pg != c10d.GroupMember.NON_GROUP_MEMBER else -1
            torch._C._distributed_c10d._set_global_rank(rank)
            self._original = None


ROUTING = Routing()
