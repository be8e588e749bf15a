"""Split nested inputs across devices and join nested outputs: DataParallel's scatter and gather.

Tensors are split along `dim` as `Tensor.chunk` splits them (torch.nn.DataParallel's rule): chunks of
ceil(n / k) rows, so a batch of 5 over 4 devices gives 3 chunks (2, 2, 1) and uses 3 devices. Tuples,
lists, dicts and namedtuples are walked; anything else goes to every replica as is. Moves between devices
are differentiable, so gradients flow back to the inputs (and from gathered outputs to the replicas).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from threadpar.errors import ConfigError


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def num_chunks(obj: Any, devices: int, dim: int) -> int:
    """How many replicas the inputs feed: `devices`, fewer when a tensor has fewer rows than devices."""
    chunks = devices
    for t in _tensors(obj):
        if t.dim() == 0:
            raise ConfigError(
                "DataParallel cannot split a 0-dim tensor input across devices; give it a batch dimension, "
                "or pass it inside a non-tensor object to send it to every replica unchanged"
            )
        if not -t.dim() <= dim < t.dim():
            raise ConfigError(
                f"DataParallel: dim={dim} is out of range for an input of shape {list(t.shape)}"
            )
        rows = t.shape[dim]
        chunks = min(chunks, len(t.chunk(devices, dim)) if rows else 1)
    return chunks


def _split(obj: Any, devices: Sequence[torch.device], dim: int) -> list[Any]:
    """One copy of `obj` per device, with every tensor replaced by its chunk on that device."""
    n = len(devices)
    if isinstance(obj, torch.Tensor):
        chunks = obj.chunk(n, dim) if obj.shape[dim] else (obj,) * n
        return [chunk.to(device) for chunk, device in zip(chunks, devices)]
    if _is_namedtuple(obj):
        return [type(obj)(*items) for items in zip(*(_split(o, devices, dim) for o in obj))]
    if isinstance(obj, tuple) and obj:
        return list(zip(*(_split(o, devices, dim) for o in obj)))
    if isinstance(obj, list) and obj:
        return [list(items) for items in zip(*(_split(o, devices, dim) for o in obj))]
    if isinstance(obj, dict) and obj:
        return [type(obj)(pairs) for pairs in zip(*(_split(kv, devices, dim) for kv in obj.items()))]
    return [obj] * n


def scatter_kwargs(
    inputs: tuple, kwargs: dict, devices: Sequence[torch.device], dim: int
) -> tuple[list[tuple], list[dict]]:
    """Per-replica positional and keyword arguments (as many replicas as chunks, at most len(devices))."""
    n = num_chunks((inputs, kwargs), len(devices), dim)
    used = devices[:n]
    return [tuple(args) for args in _split(tuple(inputs), used, dim)], _split(dict(kwargs), used, dim)


def gather(outputs: Sequence[Any], device: torch.device, dim: int) -> Any:
    """Join per-replica outputs on `device`: tensors concatenated along `dim`, containers walked."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if all(o.dim() == 0 for o in outputs):
            warnings.warn(
                "DataParallel: the replicas returned scalars; they are returned as a vector with one entry "
                "per replica (as torch.nn.DataParallel does)",
                stacklevel=3,
            )
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if any(o.keys() != first.keys() for o in outputs):
            raise ConfigError("DataParallel: the replicas returned dicts with different keys")
        return type(first)((k, gather([o[k] for o in outputs], device, dim)) for k in first)
    if _is_namedtuple(first):
        return type(first)._make(gather(list(items), device, dim) for items in zip(*outputs))
    if isinstance(first, (tuple, list)):
        if any(len(o) != len(first) for o in outputs):
            raise ConfigError("DataParallel: the replicas returned sequences of different lengths")
        return type(first)(gather(list(items), device, dim) for items in zip(*outputs))
    return list(outputs)  # other objects: one per replica
