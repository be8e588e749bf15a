"""Unsplit checkpoints: dense tensors by parameter name, whatever the (dp, tp, pp) layout that wrote them.

Saving: every pipeline stage gathers its modules' tensor-parallel shards to dense tensors (collectives
within its TP group), and one rank per stage hands them to the caller in host memory, where they merge
into one state dict with the names of the unsplit model. A plain single-thread model loads it directly.

Loading: each rank loads the dense tensors of its own modules; TP layers keep their shard of each (their
`load_state_dict` accepts dense tensors). Optimizer state (Adam's moments) is gathered and sharded the
same way, by the parameter it belongs to, so a run resumed on another layout continues exactly. A
distributed optimizer (threadpar.parallel.ZeroRedundancyOptimizer) first gathers its DP shards: its
state_dict() is the dense one, so a run saved with ZeRO resumes with or without it, on any dp.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel import ShardSpec, TensorParallelModule, gather_dense_state_dict
from threadpar.parallel.zero.state import packed_param_groups


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> Path:
    """`torch.save(obj, path)`, all or nothing: written to a temporary file beside `path`, flushed to disk,
    then renamed over `path` (os.replace is atomic within a file system). An interruption leaves the
    previous file at `path` untouched (and no temporary file, unless the process was killed outright)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:  # also a stop (RankAborted, SystemExit, KeyboardInterrupt) mid-write
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk (a directory may not open on some systems)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return path


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (whose parameter names carry a `module.` prefix)."""
    return getattr(module, "module", module)


def _shard_specs(modules: Iterable[nn.Module]) -> dict[int, tuple[ShardSpec, ProcessGroup]]:
    """id(parameter) -> how it is split, for the sharded parameters of TP layers."""
    specs = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, TensorParallelModule):
                for name, spec in sub.shard_specs.items():
                    specs[id(getattr(sub, name))] = (spec, sub.group)
    return specs


def gather_model_state(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """The dense state dict of this rank's modules (a collective over each module's TP group)."""
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        state.update(
            {k: v.detach().cpu().clone() for k, v in gather_dense_state_dict(unwrap(module)).items()}
        )
    return state


def load_model_state(modules: Iterable[nn.Module], dense: dict[str, torch.Tensor]) -> None:
    """Load each module's entries of the dense state dict (TP layers keep their shard)."""
    for module in modules:
        inner = unwrap(module)
        wanted = inner.state_dict().keys()
        missing = [k for k in wanted if k not in dense]
        if missing:
            raise ConfigError(
                f"the checkpoint has no entries {missing[:4]}{' ...' if len(missing) > 4 else ''}; "
                "it was written for another model configuration"
            )
        inner.load_state_dict({k: dense[k] for k in wanted})


def _named_params(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for module in modules for name, p in unwrap(module).named_parameters()]


def gather_optimizer_state(optimizer: torch.optim.Optimizer, modules: Sequence[nn.Module]) -> dict[str, dict]:
    """Per-parameter optimizer state at dense shapes, keyed by parameter name (a collective, like
    gather_model_state: tensors shaped like their parameter are gathered over its TP group)."""
    specs = _shard_specs(unwrap(m) for m in modules)
    # Through state_dict(): a plain optimizer's refers to its state, a ZeroRedundancyOptimizer's is its
    # shards gathered over DP (a collective over its groups, on every rank that holds a part).
    packed = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {id(params[i]): entry for i, entry in packed.items()}
    out: dict[str, dict] = {}
    for name, param in _named_params(modules):  # the same order on every rank of a TP group
        state = per_param.get(id(param))
        if not state:
            continue
        entry = {}
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.shape == param.shape and id(param) in specs:
                spec, group = specs[id(param)]
                value = spec.gather(value, group)
            entry[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
        out[name] = entry
    return out


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, modules: Sequence[nn.Module], dense: dict[str, dict]
) -> None:
    """Shard each parameter's dense optimizer state for this rank and load it."""
    specs = _shard_specs(unwrap(m) for m in modules)
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {}
    for name, param in _named_params(modules):
        if name not in dense:
            continue
        entry = {}
        for key, value in dense[name].items():
            if isinstance(value, torch.Tensor):
                if id(param) in specs and value.dim() == param.dim() > 0:
                    spec, group = specs[id(param)]
                    value = spec.shard(value, group.rank(), group.size())
                # A private copy: the dense state is shared by every rank, and optimizers update their state
                # in place (Adam's `step` too; load_state_dict keeps a tensor that is already the right type).
                value = value.to(param.device if value.dim() else value.device, copy=True)
            entry[key] = value
        state[index[id(param)]] = entry
    optimizer.load_state_dict({"state": state, "param_groups": packed_param_groups(optimizer.param_groups)})
