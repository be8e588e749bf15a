"""Sequence parallelism's replicated parameters: the gradients that must be summed over the TP group.

Under sequence parallelism the activations outside the TP region are split along the sequence, so a
parameter replicated on every TP rank and applied there (LayerNorm weights, the bias RowParallelLinear
adds after its reduce-scatter, a position embedding added to a sequence shard) gets on each rank only the
gradient of its own part of the sequence. Summing those partial gradients over the TP group gives the
dense gradient. Megatron marks such parameters `sequence_parallel=True`; here a TP layer declares its own
(`TensorParallelModule.sequence_parallel_params`: RowParallelLinear's bias under SP), and
`mark_sequence_parallel` records others (a LayerNorm's) in the rank's table of parameter records
(threadpar.parallel.records), under the module and name, so `to_empty` keeps them; nothing is set on the
module. `allreduce_sequence_parallel_grads` sums their gradients in one collective after backward.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.groups import allreduce_grads
from threadpar.parallel.records import SequenceParallelMark, param_table, records_of
from threadpar.parallel.tensor_parallel.collectives import resolve_tp_group
from threadpar.parallel.tensor_parallel.sharding import TensorParallelModule


def mark_sequence_parallel(*modules: nn.Module, names: Iterable[str] | None = None) -> None:
    """Mark parameters of `modules` (all of them and their children's, or only those `names`) as
    replicated across the TP group and applied to sequence shards, e.g. `mark_sequence_parallel(block.ln_1)`.
    Inside a launch: the marks go to this rank's table of parameter records."""
    table = param_table()
    for module in modules:
        targets = [(module, list(names))] if names is not None else list(_own_params(module))
        for sub, own in targets:
            missing = [n for n in own if not isinstance(getattr(sub, n, None), nn.Parameter)]
            if missing:
                raise ConfigError(
                    f"{type(sub).__name__} has no parameters named {missing}; name its own parameters"
                )
            for name in own:
                table.add(sub, name, SequenceParallelMark())


def _own_params(module: nn.Module):
    for sub in module.modules():
        own = [n for n, _ in sub.named_parameters(recurse=False)]
        if own:
            yield sub, own


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The marked parameters of `module` (each once, in module order): those its TP layers declare and
    those recorded by mark_sequence_parallel."""
    own = [(sub, name, p) for sub in module.modules() for name, p in sub.named_parameters(recurse=False)]
    recorded = records_of([p for _, _, p in own])
    seen, params = set(), []
    for (sub, name, param), records in zip(own, recorded):
        declared = isinstance(sub, TensorParallelModule) and name in sub.sequence_parallel_params
        if (declared or any(isinstance(r, SequenceParallelMark) for r in records)) and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params


def allreduce_sequence_parallel_grads(module: nn.Module, group: ProcessGroup | str | None = None) -> None:
    """Sum the gradients of the marked parameters over the TP group (call after backward, before the
    optimizer step, on every TP rank). One coalesced all-reduce per dtype."""
    allreduce_grads(sequence_parallel_parameters(module), resolve_tp_group(group))
