"""`warnings.catch_warnings` in rank threads: each rank records its own warnings.

Python's `catch_warnings` (Lib/warnings.py, before 3.14's context-aware warnings) swaps process-wide state:
`warnings.filters`, `showwarning` and, to record, `_showwarnmsg_impl` (the function every warning is shown
through). Ranks that enter and leave it at different times (unittest's `assertWarns` in every rank) restore
each other's state: a rank's warning lands in another rank's log, or is shown instead of recorded, or is
suppressed by the "default" filter's once-per-location registry after another rank restored the filters.

While a launch runs, `warnings.catch_warnings` is `RankCatchWarnings`: in a rank thread, entering swaps the
process's filters for a copy only when no other rank is inside one, and the last rank to leave restores them
(a count under `_lock`); a recording rank gets its own log, which `_routed_show` fills with the warnings
its own thread emits. The filters inside are shared by the ranks inside (a `simplefilter("always")` by one
holds for all until the last leaves). Outside rank threads, and for a `module=` other than `warnings`, it is
Python's own.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

_ORIGINAL_CATCH = warnings.catch_warnings
_warnings: Any = warnings  # its private parts (filters, _filters_mutated, _showwarnmsg_impl): Lib/warnings.py
_local = threading.local()
_lock = threading.Lock()
_shared: dict[str, Any] = {"inside": 0, "saved": None}  # guarded by _lock


def bind(in_rank: bool) -> None:
    _local.in_rank = in_rank
    _local.logs = []


def _routed_show(message: Any) -> None:
    logs = getattr(_local, "logs", None)
    if logs:
        logs[-1].append(message)
    else:
        _shared["saved"][2](message)


class RankCatchWarnings(_ORIGINAL_CATCH):
    # Python's catch_warnings keeps its arguments in _module, _record and _filter (Lib/warnings.py).
    def __enter__(self) -> Any:
        me: Any = self
        self._per_rank = getattr(_local, "in_rank", False) and me._module is warnings
        if not self._per_rank:
            return super().__enter__()
        with _lock:
            if _shared["inside"] == 0:
                _shared["saved"] = (_warnings.filters, _warnings.showwarning, _warnings._showwarnmsg_impl)
                _warnings.filters = _warnings.filters[:]
                _warnings._filters_mutated()
                _warnings.showwarning = _warnings._showwarning_orig
                _warnings._showwarnmsg_impl = _routed_show
            _shared["inside"] += 1
        if me._filter is not None:
            warnings.simplefilter(*me._filter)
        if not me._record:
            return None
        log: list[Any] = []
        _local.logs.append(log)
        return log

    def __exit__(self, *exc_info: Any) -> None:
        me: Any = self
        if not getattr(self, "_per_rank", False):
            return super().__exit__(*exc_info)
        if me._record:
            _local.logs.pop()
        with _lock:
            _shared["inside"] -= 1
            if _shared["inside"] == 0:
                filters, showwarning, show_impl = _shared["saved"]
                _warnings.filters = filters
                _warnings._filters_mutated()
                _warnings.showwarning = showwarning
                _warnings._showwarnmsg_impl = show_impl
        return None


class WarningsRouting:
    """The counted installation of RankCatchWarnings as `warnings.catch_warnings` (one per process; `_lock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def install(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                warnings.catch_warnings = RankCatchWarnings  # type: ignore[assignment,misc]

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                warnings.catch_warnings = _ORIGINAL_CATCH  # type: ignore[misc]


ROUTING = WarningsRouting()
