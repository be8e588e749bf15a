"""What travels between pipeline stages: a tensor, or tensors and small constants nested in tuples, lists and
dicts. Flattening to leaves and back, calling a chunk with it, microbatch splitting and concatenation.

A structure's *spec* is plain JSON-able data, so it can travel in a message header:

    ["T", i]                       the i-th tensor leaf
    ["C", value]                   a constant: None, bool, int, float or str
    ["(", [spec, ...]]             a tuple        ["[", [spec, ...]]  a list
    ["{", [[key, spec], ...]]      a dict with str keys, in insertion order

Only plain tuple, list and dict are containers: a namedtuple or a dict subclass (e.g. a ModelOutput) would
arrive as a plain tuple or dict and lose its attributes, so it is refused with a message saying so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from threadpar.errors import ConfigError

CONSTANT_TYPES = (type(None), bool, int, float, str)
WHAT_MAY_TRAVEL = (
    "tensors, and None, bool, int, float or str constants, nested in tuples, lists and dicts with str keys"
)


def flatten(obj: Any, where: str) -> tuple[list, list[torch.Tensor]]:
    """(spec, tensor leaves in order). `where` names `obj` in errors, e.g. "the output of chunk 2"."""
    leaves: list[torch.Tensor] = []

    def walk(node: Any, path: str) -> list:
        if isinstance(node, torch.Tensor):
            if node.layout is not torch.strided or node.is_quantized:
                raise ConfigError(
                    f"PipelineParallel: {where}{path} is a {node.layout} tensor{' (quantized)' * node.is_quantized}; "
                    "only dense tensors travel between stages: convert it with .to_dense() or .dequantize()"
                )
            leaves.append(node)
            return ["T", len(leaves) - 1]
        if type(node) in CONSTANT_TYPES:
            return ["C", node]
        if type(node) in (tuple, list):
            kind = "(" if type(node) is tuple else "["
            return [kind, [walk(item, f"{path}[{i}]") for i, item in enumerate(node)]]
        if type(node) is dict:
            for key in node:
                if type(key) is not str:
                    raise ConfigError(
                        f"PipelineParallel: {where}{path} is a dict with the key {key!r} ({type(key).__name__}); "
                        "dicts that travel between stages need str keys (the next chunk gets them as keyword "
                        "arguments)"
                    )
            return ["{", [[key, walk(value, f"{path}[{key!r}]")] for key, value in node.items()]]
        hint = (
            "convert it to a plain tuple or dict (its attributes would not survive the trip)"
            if isinstance(node, (tuple, dict))
            else "make it a tensor, or keep it on the stage that uses it"
        )
        raise ConfigError(
            f"PipelineParallel: {where}{path or ''} is a {type(node).__module__}.{type(node).__qualname__}, which "
            f"cannot travel between pipeline stages; {hint}. What may travel: {WHAT_MAY_TRAVEL}"
        )

    return walk(obj, ""), leaves


def unflatten(spec: list | tuple, leaves: list[torch.Tensor]) -> Any:
    kind, body = spec
    if kind == "T":
        return leaves[body]
    if kind == "C":
        return body
    if kind == "(":
        return tuple(unflatten(s, leaves) for s in body)
    if kind == "[":
        return [unflatten(s, leaves) for s in body]
    return {key: unflatten(s, leaves) for key, s in body}


def call_chunk(chunk: nn.Module, x: Any) -> Any:
    """Feed a chunk what the previous one returned: a tuple or list as positional arguments (as
    torch.distributed.pipelining does), a dict as keyword arguments, anything else as the one argument."""
    if type(x) in (tuple, list):
        return chunk(*x)
    if type(x) is dict:
        return chunk(**x)
    return chunk(x)


def split_microbatches(batch: Any, n: int, what: str) -> list:
    """`batch` cut into n equal microbatches along dim 0 of every tensor leaf (constants go to each)."""
    stage = "first" if what == "inputs" else "last"
    if isinstance(batch, torch.Tensor):  # the common case, kept free of the tree walk
        _check_divisible(batch, n, what)
        return list(batch.split(batch.shape[0] // n))
    spec, leaves = flatten(batch, what)
    if not leaves:
        raise TypeError(
            f"PipelineParallel: the {stage} stage needs {what} as a tensor (or tensors in a tuple, list or "
            f"dict) whose dim 0 is the batch, got {type(batch).__name__} without tensors"
        )
    paths = _leaf_paths(spec, what)
    for leaf, path in zip(leaves, paths):
        _check_divisible(leaf, n, path)
    pieces = [leaf.split(leaf.shape[0] // n) for leaf in leaves]  # pieces[leaf][microbatch]
    return [unflatten(spec, [p[m] for p in pieces]) for m in range(n)]


def _check_divisible(tensor: torch.Tensor, n: int, name: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] % n:
        size = tensor.shape[0] if tensor.dim() else "no"
        raise ConfigError(
            f"PipelineParallel: {name} has batch size {size} (dim 0), which must be a multiple of "
            f"num_microbatches={n} so that every microbatch has the same size"
        )


def _leaf_paths(spec: list, root: str) -> list[str]:
    """The path of every tensor leaf, in leaf order, e.g. inputs[1] or inputs['mask']."""
    paths: list[str] = []

    def walk(node: list, path: str) -> None:
        kind, body = node
        if kind == "T":
            paths.append(path)
        elif kind in "([":
            for i, child in enumerate(body):
                walk(child, f"{path}[{i}]")
        elif kind == "{":
            for key, child in body:
                walk(child, f"{path}[{key!r}]")

    walk(spec, root)
    return paths


def concat_microbatches(outputs: list) -> Any:
    """The last stage's microbatch outputs as one batch: tensors concatenated along dim 0 (0-dim tensors,
    e.g. per-microbatch aux losses, stacked into [n]), constants as a list of the n values."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    flat = [flatten(out, "the output of the last chunk") for out in outputs]
    spec = flat[0][0]
    for m, (other, _) in enumerate(flat):
        if other != spec and _without_constants(other) != _without_constants(spec):
            raise ConfigError(
                f"PipelineParallel: eval_step cannot concatenate the last chunk's outputs: microbatch {m} "
                f"returned another structure than microbatch 0 ({other} vs {spec})"
            )
    leaves = []
    for i in range(len(flat[0][1])):
        parts = [leaves_m[i] for _, leaves_m in flat]
        leaves.append(torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts))
    return unflatten(_constants_as_lists(spec, [s for s, _ in flat]), leaves)


def _without_constants(spec: list) -> Any:
    kind, body = spec
    if kind == "C":
        return "C"
    if kind == "T":
        return spec
    if kind == "{":
        return [kind, [[k, _without_constants(s)] for k, s in body]]
    return [kind, [_without_constants(s) for s in body]]


def _constants_as_lists(spec: list, specs: list[list]) -> list:
    """`spec` with each constant replaced by the list of that constant's value in every microbatch."""
    kind, body = spec
    if kind == "C":
        return ["C", [s[1] for s in specs]]
    if kind == "T":
        return spec
    if kind == "{":
        return [
            kind,
            [[k, _constants_as_lists(s, [o[1][j][1] for o in specs])] for j, (k, s) in enumerate(body)],
        ]
    return [kind, [_constants_as_lists(s, [o[1][j] for o in specs]) for j, s in enumerate(body)]]
