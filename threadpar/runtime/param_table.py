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
from torch.utils.weak import WeakIdKeyDictionary

R = TypeVar("R")


class ParamTable(Generic[R]):
    """Records per parameter, oldest first (a later record says the later word). Modules and bare
    parameters are held weakly: the table keeps nothing alive. `_lock` guards both tables and the counter
    (the rank thread writes; its comm worker and DataParallel's replica threads may read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0  # orders records across the two tables
        self._slots: list[tuple[weakref.ReferenceType[nn.Module], str, int, R]] = []
        self._bare: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> list[(order, R)]

    def add(self, module: nn.Module, name: str, record: R) -> None:
        """Record `record` for the parameter `module` holds as `name` (its own, not a child's)."""
        if name not in module._parameters:
            raise KeyError(f"{type(module).__name__} has no parameter of its own named {name!r}")
        with self._lock:
            self._count += 1
            self._slots.append((weakref.ref(module), name, self._count, record))
            self._bare.setdefault(module._parameters[name], []).append((self._count, record))

    def add_parameter(self, param: torch.Tensor, record: R) -> None:
        """Record `record` for a parameter given without its module."""
        with self._lock:
            self._count += 1
            self._bare.setdefault(param, []).append((self._count, record))

    def records(self, params: Iterable[torch.Tensor]) -> list[list[R]]:
        """Each parameter's records, oldest first (empty when none). One pass over the table per call, so
        ask for all parameters at once."""
        params = list(params)
        with self._lock:
            by_id: dict[int, list[tuple[int, R]]] = {}
            live = []
            for slot in self._slots:
                module = slot[0]()
                if module is None:
                    continue  # its module is gone
                live.append(slot)
                param = module._parameters.get(slot[1])
                if param is not None:
                    by_id.setdefault(id(param), []).append((slot[2], slot[3]))
            self._slots = live
            # A record found both ways (through the module and the parameter) counts once: keyed by its order.
            found = [dict([*self._bare.get(p, ()), *by_id.get(id(p), ())]) for p in params]
        return [[entries[order] for order in sorted(entries)] for entries in found]
