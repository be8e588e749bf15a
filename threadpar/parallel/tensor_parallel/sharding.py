"""How TP layers split dense parameters across a group, and how to put them back together.

A TP model is exactly the dense model split: every sharded parameter has a ShardSpec saying along which
dim it is split, how the (possibly padded) dense size maps onto the ranks, and how to undo it. The base
class of the TP layers uses it to accept dense tensors in `load_state_dict`, and `gather_dense_state_dict`
/ `gather_dense_grads` use it to rebuild dense tensors from the shards (collectives: every rank of each
TP group calls them, in the same order).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.grad_holder import check_grads_in_params
from threadpar.parallel.tensor_parallel.collectives import all_gather_along_dim, resolve_tp_group


def padded_size(size: int, tp: int, multiple: int = 1) -> int:
    """`size` rounded up so that each of the `tp` shards is a multiple of `multiple` (Megatron's vocab padding)."""
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ConfigError(f"the padding multiple must be a positive int, got {multiple!r}")
    step = multiple * tp
    return -(-size // step) * step


@dataclass(frozen=True)
class ShardSpec:
    """A parameter split along `dim`: `size` dense entries, padded with zeros to `padded`, in `stride`
    interleaved blocks that are each split across the ranks (a fused q/k/v projection has stride 3)."""

    dim: int
    size: int
    padded: int
    stride: int = 1

    def local_size(self, tp: int) -> int:
        return self.padded // tp

    def accepts_dense(self, shape: torch.Size, local_shape: torch.Size) -> bool:
        """Whether a tensor of `shape` is a dense (unsplit) version of a parameter of `local_shape`."""
        if len(shape) != len(local_shape) or shape[self.dim] not in (self.size, self.padded):
            return False
        return all(a == b for i, (a, b) in enumerate(zip(shape, local_shape)) if i != self.dim)

    def shard(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Rank `rank`'s part of the dense tensor `full` (unpadded or padded)."""
        n = full.shape[self.dim]
        if n == self.size and self.padded != self.size:
            pad = full.new_zeros((*full.shape[: self.dim], self.padded - n, *full.shape[self.dim + 1 :]))
            full = torch.cat([full, pad], dim=self.dim)
        elif n != self.padded:
            raise ConfigError(
                f"expected a dense tensor with {self.size} (or padded {self.padded}) entries along dim "
                f"{self.dim}, got shape {list(full.shape)}"
            )
        rows = full.movedim(self.dim, 0)
        block = self.padded // (self.stride * tp)
        # [stride * tp * block, ...] -> [stride, tp, block, ...]: rank r keeps block r of every stride.
        mine = rows.reshape(self.stride, tp, block, *rows.shape[1:])[:, rank]
        return mine.reshape(self.stride * block, *rows.shape[1:]).movedim(0, self.dim).contiguous()

    def gather(self, local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """The dense (unpadded) tensor from every rank's `local` shard (a collective on `group`)."""
        tp = group.size()
        rows = local.movedim(self.dim, 0)
        gathered = all_gather_along_dim(rows, 0, group) if tp > 1 else rows  # [tp * stride * block, ...]
        block = self.padded // (self.stride * tp)
        dense = gathered.reshape(tp, self.stride, block, *rows.shape[1:]).transpose(0, 1)
        dense = dense.reshape(self.padded, *rows.shape[1:])[: self.size]
        return dense.movedim(0, self.dim).contiguous()


class TensorParallelModule(nn.Module):
    """Base of the TP layers: the group handle captured when built, and how each parameter is sharded.

    `load_state_dict` takes dense tensors for sharded parameters (they are split here) as well as tensors
    already of the local shape. Parameter names absent from `shard_specs` are replicated on every rank.
    """

    def __init__(self, group: ProcessGroup | str | None) -> None:
        super().__init__()
        self.group = resolve_tp_group(group)
        self.tp_size = self.group.size()
        self.tp_rank = self.group.rank()
        self.shard_specs: dict[str, ShardSpec] = {}
        # Names of its own parameters that are replicated on the TP ranks but applied to sequence shards
        # (their gradients are summed over TP: threadpar.parallel.tensor_parallel.sequence_parallel).
        self.sequence_parallel_params: frozenset[str] = frozenset()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # torch.nn.Module.load_state_dict hands each module its own copy of the dict, to edit like this.
        for name, spec in self.shard_specs.items():
            param, value = getattr(self, name), state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and spec.accepts_dense(value.shape, param.shape):
                state_dict[prefix + name] = spec.shard(value, self.tp_rank, self.tp_size)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_dense_(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of each dense tensor (by parameter name) into the parameters."""
        with torch.no_grad():
            for name, full in tensors.items():
                spec = self.shard_specs.get(name)
                value = full if spec is None else spec.shard(full, self.tp_rank, self.tp_size)
                getattr(self, name).copy_(value)

    def __deepcopy__(self, memo: dict) -> TensorParallelModule:
        # The copy shares the group handle: a handle is this rank's seat in a group, not data.
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new


def _sharded_modules(module: nn.Module):
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, TensorParallelModule):
            yield (prefix + "." if prefix else ""), sub


def gather_dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded tensor gathered to its dense shape, on every rank.

    A collective: all ranks of the TP groups call it together. The keys and shapes are those of the dense
    model the TP model was split from, so the result loads into it (or into any TP size) directly.
    """
    state = module.state_dict()
    for prefix, sub in _sharded_modules(module):
        for name, spec in sub.shard_specs.items():
            key = prefix + name
            if key in state:
                state[key] = spec.gather(state[key], sub.group)
    return state


def gather_dense_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradient of every parameter (by name, as `named_parameters` gives them) at its dense shape.

    A collective, like `gather_dense_state_dict`. Meant for parity checks and debugging.
    """
    specs = {}
    for _, sub in _sharded_modules(module):
        for name, spec in sub.shard_specs.items():
            specs[id(getattr(sub, name))] = (spec, sub.group)
    check_grads_in_params(module.parameters(), "gather_dense_grads")
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in module.named_parameters():
        entry = specs.get(id(param))
        if param.grad is None:
            if entry is not None and entry[1].size() > 1:
                raise ConfigError(
                    f"parameter '{name}' has no gradient; gather_dense_grads needs one on every rank"
                )
            grads[name] = None
        else:
            grads[name] = param.grad if entry is None else entry[0].gather(param.grad, entry[1])
    return grads
