"""The per-launch registry of groups (InfiniTrain's ProcessGroupFactory GetOrCreate/Get, minus the singleton).

It lives in the launch's World and dies with it, so two launches in one interpreter never share a group.
The same name, or the same ranks, always gives the same group; a group with its own timeout
(new_group(timeout=...)) is another group of the same ranks, as every torch new_group is a new communicator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from threadpar.comm.backend import Backend
from threadpar.comm.handle import GroupState
from threadpar.errors import ConfigError


class GroupRegistry:
    def __init__(
        self, world_size: int, make_backend: Callable[[str, tuple[int, ...], float | None], Backend]
    ) -> None:
        self._world_size = world_size
        self._make_backend = make_backend
        self._lock = threading.Lock()
        self._by_name: dict[str, GroupState] = {}
        self._by_ranks: dict[tuple[tuple[int, ...], float | None], GroupState] = {}

    def get_or_create(
        self, ranks: Sequence[int], name: str | None = None, timeout: float | None = None
    ) -> GroupState:
        """`timeout`: the group's own wait limit in seconds (None: the launch's)."""
        ranks = self._check_ranks(ranks)
        with self._lock:
            if name is not None and name in self._by_name:
                state = self._by_name[name]
                if state.ranks != ranks or state.timeout != timeout:
                    raise ConfigError(
                        f"group name '{name}' already names ranks {list(state.ranks)}"
                        f"{_with(state.timeout)}, not {list(ranks)}{_with(timeout)}; use another name"
                    )
                return state
            existing = self._by_ranks.get((ranks, timeout))
            if existing is not None:
                if name is not None:
                    self._by_name[name] = existing  # an alias for an existing group with the same members
                return existing
            group_name = name or self._default_name(ranks) + ("" if timeout is None else f"@{timeout:g}s")
            state = GroupState(group_name, ranks, self._make_backend(group_name, ranks, timeout), timeout)
            self._by_ranks[(ranks, timeout)] = state
            self._by_name[state.name] = state
            return state

    def backends(self) -> list[Backend]:
        """Every group's backend object, once each (a launch's end closes them)."""
        with self._lock:
            states = list(self._by_ranks.values())
        return [state.backend for state in states]

    def get(self, name: str) -> GroupState:
        with self._lock:
            state = self._by_name.get(name)
            known = sorted(self._by_name)
        if state is None:
            raise ConfigError(f"no group named '{name}' in this launch; known groups: {known}")
        return state

    def _default_name(self, ranks: tuple[int, ...]) -> str:
        if ranks == tuple(range(self._world_size)):
            return "WORLD"
        return "group" + "-".join(map(str, ranks))

    def _check_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        try:
            ranks = tuple(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise ConfigError(f"group ranks must be a sequence of ints, got {ranks!r}") from None
        if not ranks:
            raise ConfigError("a group needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"group ranks {list(ranks)} contain a duplicate")
        bad = [r for r in ranks if not 0 <= r < self._world_size]
        if bad:
            raise ConfigError(
                f"group ranks {bad} are outside 0..{self._world_size - 1} (world_size={self._world_size})"
            )
        return ranks


def _with(timeout: float | None) -> str:
    return "" if timeout is None else f" with timeout {timeout:g} s"
