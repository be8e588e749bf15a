"""One rank's table of parameter records: what the wrappers (DDP, the placement marking) say about parameters.

It lives in the rank's RankContext (`RankContext.params`), never in a module global (DESIGN.md rule 1), and
the records' type is the parallel layer's (threadpar.parallel.records.ParamRecord). A record is kept under
the module and the name that hold the parameter, and under the Parameter object: `module.to_empty()` or
`load_state_dict(assign=True)` put a new Parameter under the same name, and it finds its records through
the module, so nothing has to be marked again after them; a parameter whose module is gone (a temporary
nn.ParameterList used to mark it) finds them through itself. A bare parameter is kept under itself alone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Generic, TypeVar

import torch
from torch import nn

R = TypeVar("R")


class _Under:
    """Where a record points: the parameter a module holds under a name (whichever Parameter it is now)."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self._module, self._name = weakref.ref(module), name

    def current(self) -> torch.Tensor | None:
        module = self._module()
        return None if module is None else module._parameters.get(self._name)

    def alive(self) -> bool:
        return self._module() is not None


class _Itself:
    """Where a record points: one Parameter object."""

    def __init__(self, param: torch.Tensor) -> None:
        self._param = weakref.ref(param)

    def current(self) -> torch.Tensor | None:
        return self._param()

    def alive(self) -> bool:
        return self._param() is not None


# One record as the table holds it: (order, record, where it points).
_Entry = tuple[int, R, _Under | _Itself]


class ParamTable(Generic[R]):
    """Records per parameter, oldest first (a later record says the later word). Modules and parameters are
    held weakly: the table keeps nothing alive. `_lock` guards the records, the order counter and the index
    (the rank thread writes; its comm worker and DataParallel's replica threads may read).

    Lookups go through an index by parameter identity, so a clip step costs a dict lookup per parameter; the
    index is rebuilt from the records when one was added or a parameter is not found where it was (a
    module's parameter replaced by `to_empty`, a parameter that was never recorded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0  # orders the records
        self._entries: list[_Entry] = []
        # id(parameter) -> (the parameter, weakly; its records in order), as the records point now
        self._index: dict[int, tuple[weakref.ReferenceType[torch.Tensor], tuple[R, ...]]] | None = None

    def add(self, module: nn.Module, name: str, record: R) -> None:
        """Record `record` for the parameter `module` holds as `name` (its own, not a child's)."""
        if name not in module._parameters:
            raise KeyError(f"{type(module).__name__} has no parameter of its own named {name!r}")
        param = module._parameters[name]
        assert param is not None
        self._append(record, _Under(module, name), _Itself(param))

    def add_parameter(self, param: torch.Tensor, record: R) -> None:
        """Record `record` for a parameter given without its module."""
        self._append(record, _Itself(param))

    def _append(self, record: R, *where: _Under | _Itself) -> None:
        # A module's record is found through the module (the parameter now under that name) and through the
        # parameter (once its module is gone: a temporary nn.ParameterList used to mark it).
        with self._lock:
            self._count += 1
            self._entries += [(self._count, record, place) for place in where]
            self._index = None

    def records(self, params: Iterable[torch.Tensor]) -> list[tuple[R, ...]]:
        """Each parameter's records, oldest first (empty when none); ask for all parameters at once."""
        params = list(params)
        with self._lock:
            found = self._look_up(params)
            if found is None:  # something moved (or was never recorded): rebuild the index, look again
                self._index = None
                found = self._look_up(params)
            assert found is not None
            return found

    def _look_up(self, params: list[torch.Tensor]) -> list[tuple[R, ...]] | None:
        """The records from the index; None when a parameter is not in it (after a rebuild: no records)."""
        fresh = self._index is None
        if self._index is None:
            self._rebuild()
        assert self._index is not None
        found: list[tuple[R, ...]] = []
        for param in params:
            hit = self._index.get(id(param))
            if hit is None or hit[0]() is not param:  # not there, or another object that had this id
                if not fresh:
                    return None
                found.append(())
            else:
                found.append(hit[1])
        return found

    def _rebuild(self) -> None:
        """Drop what is gone; index every parameter the records point at now (records deduplicated by order:
        a module's record points at its parameter twice)."""
        live = [entry for entry in self._entries if entry[2].alive()]
        by_param: dict[int, tuple[torch.Tensor, dict[int, R]]] = {}
        for order, record, place in live:
            param = place.current()
            if param is not None:
                by_param.setdefault(id(param), (param, {}))[1][order] = record
        self._entries = live
        self._index = {
            key: (weakref.ref(param), tuple(records[order] for order in sorted(records)))
            for key, (param, records) in by_param.items()
        }
