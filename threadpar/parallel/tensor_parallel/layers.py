"""Column- and row-parallel linear layers (Megatron / InfiniTrain semantics).

    Y = X W^T + b,  W: [out_features, in_features]

ColumnParallelLinear splits W by output features: rank r holds rows r*out/tp .. (r+1)*out/tp and
computes that slice of Y from the whole X. RowParallelLinear splits W by input features: rank r holds
columns of W, multiplies its slice of X, and the partial products are summed over the group. An MLP is
column -> activation -> row with one all-reduce in the forward and one in the backward; under sequence
parallelism these become an all-gather before the column layer and a reduce-scatter after the row layer.

Both layers take `group=None` meaning this rank's TP group, resolved (and captured) when built.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel.async_linear import linear_with_async_grad_comm, resolve_overlap
from threadpar.parallel.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
)
from threadpar.parallel.tensor_parallel.random import INIT, get_rng_tracker
from threadpar.parallel.tensor_parallel.sharding import ShardSpec, TensorParallelModule, padded_size


def check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def check_sequence_dim(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"sequence_dim must be an int (1 for [batch, seq, hidden]), got {value!r}")
    return value


class _ParallelLinear(TensorParallelModule):
    """What both linear layers share: parameters, dense initialisation, from_dense, repr."""

    def __init__(self, in_features, out_features, bias, group, sequence_dim, device, dtype) -> None:
        super().__init__(group)
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        self.sequence_dim = check_sequence_dim(sequence_dim)
        self._factory = {"device": device, "dtype": dtype}
        self.has_bias = bool(bias)

    def _create_parameters(self, weight_shape: tuple[int, int], bias_size: int) -> None:
        self.weight = nn.Parameter(torch.empty(weight_shape, **self._factory))
        if self.has_bias:
            self.bias = nn.Parameter(torch.empty(bias_size, **self._factory))
        else:
            self.register_parameter("bias", None)
        del self._factory
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the dense weight and bias, drawn from the TP group's shared INIT
        stream; each rank keeps its shard, so the layer equals the dense one split at any TP size."""
        if self.weight.is_meta:
            return
        generator = get_rng_tracker().generator(INIT)
        like: dict[str, Any] = {"device": generator.device, "dtype": self.weight.dtype}
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) of nn.Linear
        dense = {"weight": torch.empty(self.out_features, self.in_features, **like)}
        if self.bias is not None:
            dense["bias"] = torch.empty(self.out_features, **like)
        for tensor in dense.values():
            nn.init.uniform_(tensor, -bound, bound, generator=generator)
        self.load_dense_(dense)

    @classmethod
    def from_dense(cls, linear: nn.Linear, **kwargs):
        """This rank's shard of `linear` as a TP layer (same device and dtype); kwargs as the constructor's."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense needs an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        has_bias = linear.bias is not None
        layer = cls(
            linear.in_features, linear.out_features, has_bias, device="meta", dtype=weight.dtype, **kwargs
        )
        layer.to_empty(device=weight.device)
        layer.load_dense_(dict(linear.named_parameters(recurse=False)))
        for name, param in layer.named_parameters(recurse=False):
            param.requires_grad_(getattr(linear, name).requires_grad)
        return layer

    def _extra(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_size}, rank={self.tp_rank}, local weight={list(self.weight.shape)}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with W split by output features; the output is this rank's slice of features.

    gather_output: all-gather the output to every rank (else it stays split, ready for a row layer).
    input_is_parallel: the input already entered the TP region (e.g. several column layers share one
        copy_to_tp_region), so no copy is inserted.
    skip_bias_add: return (output, bias) without adding the bias (to fuse it into what follows).
    sequence_parallel: the input is split along `sequence_dim`; it is all-gathered first and its gradient
        reduce-scattered.
    stride: the output holds `stride` blocks (a fused q/k/v projection: 3) that are each split.
    pad_out_features_to_multiple_of: pad out_features so each shard is a multiple of it (a vocabulary
        head; pass the embedding's pad_vocab_to_multiple_of to tie them). Padded outputs are zero.
    overlap_grad_comm: in backward, run the all-reduce (reduce-scatter under SP) of the input gradient
        while the weight gradient is computed (async_linear.py); under SP the input is then gathered again
        in backward instead of being kept. False: the mappings and F.linear, one collective after the other.
        None (default): on where it helps (nccl; threads with a spare core: `resolve_overlap`). No effect
        with input_is_parallel=True (no collective on the input gradient here).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | str | None = None,
        stride: int = 1,
        pad_out_features_to_multiple_of: int | None = None,
        sequence_dim: int = 1,
        overlap_grad_comm: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, sequence_dim, device, dtype)
        self.overlap_grad_comm = resolve_overlap(overlap_grad_comm, self.group)
        if sequence_parallel and input_is_parallel:
            raise ConfigError(
                "ColumnParallelLinear: sequence_parallel=True means the input arrives split along the "
                "sequence (it is all-gathered here); input_is_parallel=True means it was already gathered "
                "or copied into the TP region. Pass one of them."
            )
        if gather_output and skip_bias_add:
            raise ConfigError(
                "ColumnParallelLinear: skip_bias_add=True returns this rank's bias shard, which does not "
                "match a gathered output; use gather_output=False, or let the layer add the bias"
            )
        self.stride = check_positive_int("stride", stride)
        tp = self.tp_size
        if pad_out_features_to_multiple_of is None:
            padded = out_features
            if out_features % (tp * stride):
                raise ConfigError(
                    f"ColumnParallelLinear: out_features={out_features} must be divisible by the TP size "
                    f"{tp}{f' times stride {stride}' if stride > 1 else ''}; choose another size (for a "
                    "vocabulary head, pass pad_out_features_to_multiple_of=1 to pad it)"
                )
        else:
            if stride != 1:
                raise ConfigError(
                    "ColumnParallelLinear: padding is for vocabulary heads; use it with stride=1"
                )
            padded = padded_size(out_features, tp, pad_out_features_to_multiple_of)
        self.padded_out_features = padded
        self.gather_output = bool(gather_output)
        self.input_is_parallel = bool(input_is_parallel)
        self.skip_bias_add = bool(skip_bias_add)
        self.sequence_parallel = bool(sequence_parallel)
        spec = ShardSpec(0, out_features, padded, stride)
        self.shard_specs = {"weight": spec, **({"bias": spec} if bias else {})}
        self._create_parameters((padded // tp, in_features), padded // tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # x: [..., in] (split along sequence_dim under SP) -> [..., out / tp], or [..., out] gathered
        bias = None if self.skip_bias_add else self.bias
        if self.overlap_grad_comm and not self.input_is_parallel:
            sequence_dim = self.sequence_dim if self.sequence_parallel else None
            out = linear_with_async_grad_comm(x, self.weight, bias, self.group, sequence_dim=sequence_dim)
        else:
            if self.sequence_parallel:
                x = gather_from_sp_region(x, self.group, dim=self.sequence_dim)
            elif not self.input_is_parallel:
                x = copy_to_tp_region(x, self.group)
            out = F.linear(x, self.weight, bias)
        if self.gather_output:
            out = gather_from_tp_region(out, self.group)
            if self.padded_out_features != self.out_features:
                out = out[..., : self.out_features]
        return (out, self.bias) if self.skip_bias_add else out

    def extra_repr(self) -> str:
        names = ("gather_output", "input_is_parallel", "skip_bias_add", "sequence_parallel")
        flags = [f"{f}=True" for f in names if getattr(self, f)]
        flags.append(f"overlap_grad_comm={self.overlap_grad_comm}")
        stride = [f"stride={self.stride}"] if self.stride > 1 else []
        return ", ".join([self._extra(), *stride, *flags])


class RowParallelLinear(_ParallelLinear):
    """Linear layer with W split by input features; partial outputs are summed over the group.

    input_is_parallel: the input is already split by features (the output of a column layer); else this
        rank's slice is taken here.
    reduce_output: all-reduce the partial outputs (reduce-scatter along `sequence_dim` under sequence
        parallelism); with False the caller reduces them, and adds the bias (skip_bias_add=True).
    The bias is replicated and added once, after the reduction. Under sequence parallelism its gradient
    is partial on each rank: allreduce_sequence_parallel_grads sums it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        reduce_output: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | str | None = None,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, sequence_dim, device, dtype)
        if sequence_parallel and not (input_is_parallel and reduce_output):
            raise ConfigError(
                "RowParallelLinear: sequence_parallel=True reduce-scatters the output of a feature-split "
                "input; it needs input_is_parallel=True and reduce_output=True"
            )
        if bias and not reduce_output and not skip_bias_add:
            raise ConfigError(
                "RowParallelLinear: with reduce_output=False the output is a partial sum and the bias must "
                "be added once, after you reduce it; pass skip_bias_add=True (forward returns "
                "(output, bias)) or bias=False"
            )
        if in_features % self.tp_size:
            raise ConfigError(
                f"RowParallelLinear: in_features={in_features} must be divisible by the TP size "
                f"{self.tp_size}; choose another size"
            )
        self.input_is_parallel = bool(input_is_parallel)
        self.reduce_output = bool(reduce_output)
        self.skip_bias_add = bool(skip_bias_add)
        self.sequence_parallel = bool(sequence_parallel)
        self.shard_specs = {"weight": ShardSpec(1, in_features, in_features)}
        if bias and sequence_parallel:
            self.sequence_parallel_params = frozenset({"bias"})
        self._create_parameters((out_features, in_features // self.tp_size), out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # x: [..., in / tp] (or [..., in] with input_is_parallel=False) -> [..., out], split along
        # sequence_dim under SP
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        out = F.linear(x, self.weight)  # this rank's partial sum
        if self.reduce_output:
            if self.sequence_parallel:
                out = reduce_scatter_to_sp_region(out, self.group, dim=self.sequence_dim)
            else:
                out = reduce_from_tp_region(out, self.group)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        flags = [f"{f}=True" for f in ("skip_bias_add", "sequence_parallel") if getattr(self, f)]
        flags += [f"{f}=False" for f in ("input_is_parallel", "reduce_output") if not getattr(self, f)]
        return ", ".join([self._extra(), *flags])
