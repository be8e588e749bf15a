"""The distributed optimizer's state at dense shapes: gathered from the shards, and sharded again on load.

The state of an element-wise optimizer (Adam's moments, SGD's momentum) is one tensor shaped like the
parameter plus scalars (`step`). Each rank holds the element-wise state of its pieces only; gathering it is
one all-gather per bucket and key, and the scalars come from the rank that holds each parameter's first
element. The result is what a plain torch optimizer keeps per parameter, so a state saved with ZeRO on
dp=4 loads on dp=2, or into a plain optimizer, and the other way round.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.errors import ConfigError
from threadpar.parallel.zero.shard import Shard

MASTER_KEY = "master_weight"  # fp32 master weights of bf16/fp16 parameters, saved with the state


@dataclass(frozen=True)
class StateSchema:
    """The per-parameter state an optimizer class keeps: element-wise keys and scalar keys (with dtype)."""

    elementwise: tuple[str, ...]
    scalars: tuple[tuple[str, torch.dtype], ...]
    scalars_on_device: bool = False  # capturable/fused optimizers keep `step` on the parameter's device

    @property
    def keys(self) -> set[str]:
        return {*self.elementwise, *(k for k, _ in self.scalars)}


def _run(optimizer_class: type, hyper: dict[str, Any], params: list[torch.Tensor], grads: list[list]) -> Any:
    optimizer = optimizer_class(params, **hyper)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        optimizer.step()
    return optimizer


def probe_schema(optimizer_class: type, hyper: dict[str, Any], like: torch.Tensor) -> StateSchema:
    """Check that `optimizer_class` is element-wise, and what per-parameter state it keeps.

    ZeRO splits a parameter into 1-D pieces and steps them separately, which is exact only when the
    optimizer treats every element on its own (Adam, SGD, ...). So: step a throwaway [2, 3] tensor twice,
    and its two 1-D pieces [0:2] and [2:6] side by side with the same gradients; the results and the
    state shapes must agree (Adafactor's factored moments, for one, do not)."""
    g = torch.Generator().manual_seed(0)
    dtype = like.dtype if like.dtype.is_floating_point and like.element_size() >= 4 else torch.float32
    start = torch.randn(2, 3, generator=g).to(like.device, dtype)
    grads = [torch.randn(2, 3, generator=g).to(like.device, dtype) for _ in range(2)]
    whole = start.clone()
    pieces = [start.reshape(-1)[:2].clone(), start.reshape(-1)[2:].clone()]
    name = optimizer_class.__name__
    try:
        dense = _run(optimizer_class, hyper, [whole], [[gr] for gr in grads])
        _run(optimizer_class, hyper, pieces, [[gr.reshape(-1)[:2], gr.reshape(-1)[2:]] for gr in grads])
    except Exception as error:
        raise ConfigError(
            f"ZeroRedundancyOptimizer: {name}({hyper}) cannot step a plain tensor "
            f"({type(error).__name__}: {error}); give an element-wise torch optimizer such as AdamW or SGD"
        ) from error
    elementwise, scalars, on_device = [], [], False
    for key, value in dense.state[whole].items():
        if isinstance(value, torch.Tensor) and value.shape == whole.shape:
            elementwise.append(key)
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            scalars.append((key, value.dtype))
            on_device = on_device or (value.device == whole.device and whole.device.type != "cpu")
        else:
            raise ConfigError(
                f"ZeroRedundancyOptimizer: {name} keeps state {key!r} that is neither shaped like its "
                "parameter nor a scalar, so it cannot be split element by element over the DP group; use an "
                "element-wise optimizer (AdamW, Adam, SGD, ...)"
            )
    if not torch.allclose(torch.cat(pieces), whole.reshape(-1), rtol=1e-4, atol=1e-6):
        raise ConfigError(
            f"ZeroRedundancyOptimizer: {name} does not update each element on its own (stepping a tensor in "
            "two pieces gives another result than stepping it whole), so it cannot be split element by "
            "element over the DP group; use an element-wise optimizer (AdamW, Adam, SGD, ...)"
        )
    return StateSchema(tuple(sorted(elementwise)), tuple(sorted(scalars, key=lambda s: s[0])), on_device)


def gather_dense(shards: list[Shard], state: dict, schema: StateSchema) -> dict[torch.nn.Parameter, dict]:
    """Every parameter's state at its own shape (a collective over each bucket's group, in bucket order).
    `state`: the wrapped optimizer's state (piece tensor -> dict)."""
    out: dict[torch.nn.Parameter, dict] = {}
    for shard in shards:
        bucket = shard.bucket
        n = len(bucket.params)
        # Scalars and "has state", from the rank holding each parameter's first element: one SUM.
        header = torch.zeros(n, 1 + len(schema.scalars), dtype=torch.float64, device=bucket.flat.device)
        for piece, tensor in zip(bucket.pieces, shard.tensors):
            held = state.get(tensor)
            if piece.lo == 0 and held:
                header[piece.index, 0] = 1
                for c, (key, _) in enumerate(schema.scalars, start=1):
                    header[piece.index, c] = float(held[key])
        if bucket.group.size() > 1:
            bucket.group.all_reduce(header, ReduceOp.SUM)
        columns: dict[str, list[torch.Tensor]] = {}
        keys = [*schema.elementwise, *([MASTER_KEY] if shard.master is not None else [])]
        for key in keys:
            local = torch.zeros_like(shard.values)  # [S]
            if key == MASTER_KEY:
                local.copy_(shard.values)
            for tensor, piece in zip(shard.tensors, bucket.pieces):
                value = state.get(tensor, {}).get(key) if key != MASTER_KEY else None
                if value is not None:
                    local[piece.shard_offset : piece.shard_offset + piece.hi - piece.lo].copy_(value)
            full = local.new_empty(local.numel() * bucket.group.size())
            if bucket.group.size() > 1:
                bucket.group.all_gather_into_tensor(full, local)
            else:
                full.copy_(local)
            columns[key] = bucket.split_full(full)
        flags = header.cpu()
        for i, param in enumerate(bucket.params):
            if not flags[i, 0]:
                continue
            entry: dict[str, Any] = {k: columns[k][i].clone() for k in keys}
            for c, (key, dtype) in enumerate(schema.scalars, start=1):
                entry[key] = torch.tensor(float(flags[i, c]), dtype=dtype)
            out[param] = entry
    return out


def check_dense(
    dense: dict[torch.nn.Parameter, dict], names: dict[int, str], schema: StateSchema, class_name: str
) -> None:
    """Refuse (before anything changes) state written by another optimizer class or for other shapes."""
    for param, entry in dense.items():
        keys = set(entry) - {MASTER_KEY}
        if keys != schema.keys:
            raise ConfigError(
                f"ZeroRedundancyOptimizer.load_state_dict: the state of parameter {names[id(param)]} has keys "
                f"{sorted(keys)}, but {class_name} keeps {sorted(schema.keys)}: it was written by another "
                f"optimizer class; load it into the class that wrote it (or start that optimizer afresh)"
            )
        for key in (*schema.elementwise, *([MASTER_KEY] if MASTER_KEY in entry else [])):
            value = entry[key]
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ConfigError(
                    f"ZeroRedundancyOptimizer.load_state_dict: state {key!r} of parameter {names[id(param)]} "
                    f"is {got}, not the parameter's shape {tuple(param.shape)}; it was saved for another model "
                    "or layout (threadpar.checkpoint loads across layouts)"
                )


def load_dense(shards: list[Shard], dense: dict[torch.nn.Parameter, dict], schema: StateSchema) -> dict:
    """The wrapped optimizer's new state (piece tensor -> dict): this rank's slices of `dense`, copied.
    Master weights come from the saved ones when present, else they stay the parameters' values."""
    state: dict[torch.Tensor, dict] = {}
    for shard in shards:
        for piece, tensor in zip(shard.bucket.pieces, shard.tensors):
            entry = dense.get(shard.bucket.params[piece.index])
            if entry is None:
                continue
            new: dict[str, Any] = {}
            for key in schema.elementwise:
                part = entry[key].detach().reshape(-1)[piece.lo : piece.hi]
                new[key] = part.to(device=tensor.device, dtype=tensor.dtype, copy=True)
            for key, dtype in schema.scalars:
                device = tensor.device if schema.scalars_on_device else torch.device("cpu")
                new[key] = torch.as_tensor(entry[key], dtype=dtype).to(device, copy=True)
            if shard.master is not None and MASTER_KEY in entry:
                tensor.copy_(entry[MASTER_KEY].detach().reshape(-1)[piece.lo : piece.hi])
            state[tensor] = new
    return state


def packed_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups as torch's optimizer state dicts hold them: parameters replaced by their running index."""
    packed, start = [], 0
    for group in groups:
        n = len(group["params"])
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        packed.append({**hyper, "params": list(range(start, start + n))})
        start += n
    return packed
