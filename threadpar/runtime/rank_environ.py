"""torchrun's environment variables per rank thread: `os.environ` and `os.getenv` in a rank see its own.

torchrun starts each worker process with RANK, LOCAL_RANK, WORLD_SIZE, ... set for that worker
(torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`); code written for it reads
them with `os.environ[...]` or `os.getenv(...)`. Rank threads share one process environment, so while a
launch runs `os.environ` is a `RoutedEnviron`: in a rank thread the names of `PER_RANK` come from the
rank's own table (reads, writes and deletes stay there), every other name is the process's environment
(shared, as threads share it, and visible to C code: a script that sets NCCL_DEBUG still reaches NCCL). In
every other thread, and for C code (`getenv`), the process's environment is exactly as it was.
`os.getenv` reads `os.environ` (Lib/os.py), so it follows.

Installing is counted (nested or concurrent launches share one installation; the last one out restores
the original object).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

# The variables torchrun sets per worker (local_elastic_agent.py `_start_workers` and `_set_local_rank_env`),
# which differ between a job's ranks or name its rendezvous.
PER_RANK = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
_PER_RANK = frozenset(PER_RANK)

_local = threading.local()
_DELETED = object()  # a per-rank variable the rank deleted


def bind(values: Mapping[str, str] | None) -> None:
    """The calling thread's own values of the PER_RANK variables (None: the process's again)."""
    _local.values = None if values is None else dict(values)


def bound() -> dict[str, Any] | None:
    return getattr(_local, "values", None)


class RoutedEnviron(MutableMapping[str, str]):
    """Stands in for `os.environ`: PER_RANK names from the calling rank thread's table, the rest (and every
    name in any other thread) from the process's `os._Environ`."""

    def __init__(self, process: MutableMapping[str, str]) -> None:
        self.process = process

    def _own(self, key: str) -> dict[str, Any] | None:
        values = getattr(_local, "values", None)
        return values if values is not None and key in _PER_RANK else None

    def __getitem__(self, key: str) -> str:
        own = self._own(key)
        if own is None:
            return self.process[key]
        value = own.get(key, _DELETED)
        if value is _DELETED:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: str) -> None:
        own = self._own(key)
        if own is None:
            self.process[key] = value
            return
        if not isinstance(value, str):  # as os._Environ.encodevalue refuses it
            raise TypeError(f"str expected, not {type(value).__name__}")
        own[key] = value

    def __delitem__(self, key: str) -> None:
        own = self._own(key)
        if own is None:
            del self.process[key]
            return
        if own.get(key, _DELETED) is _DELETED:
            raise KeyError(key)
        own[key] = _DELETED

    def _keys(self) -> list[str]:
        values = getattr(_local, "values", None)
        keys = [k for k in list(self.process) if values is None or k not in _PER_RANK]
        if values is not None:
            keys += [k for k, v in values.items() if v is not _DELETED]
        return keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def copy(self) -> dict[str, str]:
        return dict(self)

    def __repr__(self) -> str:
        return f"environ({dict(self)!r})"

    def __or__(self, other: Mapping[str, str]) -> dict[str, str]:
        return {**self, **other}

    def __ror__(self, other: Mapping[str, str]) -> dict[str, str]:
        return {**other, **self}

    def __ior__(self, other: Mapping[str, str]) -> RoutedEnviron:
        self.update(other)
        return self


def process_environ() -> MutableMapping[str, str]:
    """The process's own environment (os._Environ), whatever thread asks: what C code and child
    processes see."""
    environ = os.environ
    return environ.process if isinstance(environ, RoutedEnviron) else environ


class EnvironRouting:
    """The counted installation of `RoutedEnviron` as `os.environ` (one per process; `_lock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original: MutableMapping[str, str] | None = None

    def install(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._original = os.environ
                os.environ = RoutedEnviron(os.environ)  # type: ignore[assignment]  # noqa: B003 (a view, not a new env)

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._original is not None:
                os.environ = self._original  # type: ignore[assignment]  # noqa: B003
                self._original = None


ROUTING = EnvironRouting()


def torchrun_values(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    process: Mapping[str, str],
) -> dict[str, str]:
    """What torchrun would set for this rank (local_elastic_agent.py `_start_workers`): one role,
    "default", so ROLE_RANK = RANK; the rendezvous (MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID) is the
    process's own when it has one, else torchrun's defaults (127.0.0.1, its --master-port 29500,
    --rdzv-id "none")."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": process.get("ROLE_NAME", "default"),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": process.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": process.get("MASTER_PORT", "29500"),
        "TORCHELASTIC_RUN_ID": process.get("TORCHELASTIC_RUN_ID", "none"),
        "TORCHELASTIC_RESTART_COUNT": process.get("TORCHELASTIC_RESTART_COUNT", "0"),
        "TORCHELASTIC_MAX_RESTARTS": process.get("TORCHELASTIC_MAX_RESTARTS", "0"),
    }
