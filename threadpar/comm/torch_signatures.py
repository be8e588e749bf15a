"""threadpar's namesakes of torch's functions take the parameters of the torch that is installed.

torch adds parameters between releases and changes defaults: 2.13 gave DistributedDataParallel
`forward_sync_buffers` (and `broadcast_buffers` the default None), 2.14 gave the object collectives
`weights_only` and init_process_group `enable_reconfigure`. A namesake is written with every parameter of the
torch releases threadpar supports (pyproject.toml), in torch's order, then threadpar's own, keyword-only.
`@follows(torch_callable)` then gives it the installed torch's parameters, so that a call torch accepts
means here what it means to that torch (DESIGN.md, API conventions):

- the namesake's torch part has the installed torch's names, kinds and defaults: it is returned unchanged
  (no wrapper, nothing paid per call);
- otherwise it is wrapped: the signature shown (`inspect.signature`) is the installed torch's parameters,
  then, keyword-only, those of the namesake's that this torch lacks (a newer torch's: on 2.11,
  `new_group(..., *, sort_ranks=True)`) and threadpar's own. A call is bound to it (torch's positions and
  torch's defaults: on 2.12 an omitted `broadcast_buffers` is True) and the namesake gets keywords. A
  parameter of the installed torch that the namesake does not know (a torch newer than the range) is
  accepted at its default; any other value is a ConfigError naming it, never silently dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import torch

from threadpar.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def described(params: list[inspect.Parameter]) -> list[tuple[str, str, object]]:
    """What a caller relies on: (name, kind, default) of each parameter; annotations are left out."""
    return [(p.name, p.kind.name, p.default) for p in params]


def follows(theirs: Callable[..., Any], *, method: bool = False) -> Callable[[F], F]:
    """Make the decorated namesake take `theirs`'s parameters (see the module docstring). `method`: both are
    methods (a constructor's `__init__`); `self` is kept as the namesake's first parameter."""

    def decorate(ours: F) -> F:
        skip = 1 if method else 0
        their_params = list(inspect.signature(theirs).parameters.values())[skip:]
        our_signature = inspect.signature(ours)
        our_all = list(our_signature.parameters.values())
        our_params = our_all[skip:]
        their_names = {p.name for p in their_params}
        own = [p for p in our_params if p.kind is KEYWORD_ONLY and p.name not in their_names]
        torch_part = [p for p in our_params if p not in own]
        if described(torch_part) == described(their_params):
            return ours
        name = getattr(ours, "__qualname__", repr(ours))
        if any(p.kind in _VARIADIC for p in their_params + our_params):
            raise TypeError(f"{name}: follows() needs named parameters on both sides")
        known = {p.name for p in our_params}
        unknown = {p.name: p.default for p in their_params if p.name not in known}
        # A newer torch's parameters stay available, keyword-only: threadpar's extras on this torch.
        newer = [p.replace(kind=KEYWORD_ONLY) for p in torch_part if p.name not in their_names]
        mirrored = our_signature.replace(parameters=our_all[:skip] + their_params + newer + own)

        @wraps(ours)
        def taking_torch_parameters(*args: Any, **kwargs: Any) -> Any:
            bound = mirrored.bind(*args, **kwargs)  # a TypeError where the installed torch raises one
            bound.apply_defaults()  # the installed torch's defaults: what an omitted argument means there
            call = bound.arguments
            for parameter, default in unknown.items():
                value = call.pop(parameter)
                if value is not default and not _equal(value, default):
                    raise ConfigError(
                        f"{name}: threadpar does not implement torch {torch.__version__}'s parameter "
                        f"{parameter} (newer than the torch releases threadpar supports); leave it at its "
                        f"default {default!r}"
                    )
            return ours(**call)

        taking_torch_parameters.__signature__ = mirrored  # type: ignore[attr-defined]
        return taking_torch_parameters  # type: ignore[return-value]

    return decorate


def _equal(value: object, default: object) -> bool:
    try:
        return bool(value == default)
    except Exception:  # (a tensor, an object whose == raises)
        return False
