"""`parallelize`: make a model written with plain nn.Linear / nn.Embedding tensor parallel, by a
`parallelize_plan` (the name torch.distributed.tensor.parallel.parallelize_module gives its argument).

    parallelize_plan = {
        "tok_emb": "vocab",                       # nn.Embedding -> VocabParallelEmbedding
        "blocks.*.attn.qkv": ColwiseParallel(stride=3),   # fused q/k/v: each block split separately
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise",
        "blocks.*.ln_*": "sequence",              # norms on sequence shards (sequence_parallel=True only)
        "blocks.*.attn.drop": "tp_dropout",       # on this rank's heads: a mask per rank
        "blocks.*.resid_drop": "dropout",         # outside the TP region (sequence shards under SP)
        "head": ColwiseParallel(gather_output=True),
    }
    parallelize(model, parallelize_plan, sequence_parallel=True)

Patterns are fnmatch patterns over module names (`*` also matches dots); every pattern must match. The
swapped layers hold this rank's shard of the dense weights, so the model computes what it did before.
Weights tied across swapped modules (an embedding and its head) stay tied. Every nn.Dropout with p > 0
must be in the parallelize_plan: nn.Dropout draws from the process-wide generator that all rank threads
share (a dropout called as F.dropout in the model's code cannot be seen here and has the same problem).

The model's own code must not depend on the split sizes: attention should infer the local number of
heads from the tensor (`q.view(batch, seq, -1, head_dim)`), and under sequence parallelism the sequence
length from the tensor it splits. Call parallelize on every rank, each with its own copy of the model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel.async_linear import resolve_overlap
from threadpar.parallel.tensor_parallel.collectives import resolve_tp_group
from threadpar.parallel.tensor_parallel.embedding import VocabParallelEmbedding
from threadpar.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_positive_int,
)
from threadpar.parallel.tensor_parallel.random import TrackedDropout
from threadpar.parallel.tensor_parallel.sequence_parallel import mark_sequence_parallel
from threadpar.parallel.tensor_parallel.sharding import TensorParallelModule


def _check_bool(owner: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(owner, name), bool):
            raise ConfigError(f"{type(owner).__name__}.{name} must be a bool, got {getattr(owner, name)!r}")


@dataclass(kw_only=True)
class ColwiseParallel:
    """nn.Linear -> ColumnParallelLinear (output split by features, or gathered)."""

    gather_output: bool = False
    input_is_parallel: bool = False
    stride: int = 1
    pad_out_features_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        _check_bool(self, "gather_output", "input_is_parallel")
        check_positive_int("ColwiseParallel.stride", self.stride)
        if self.pad_out_features_to_multiple_of is not None:
            check_positive_int(
                "ColwiseParallel.pad_out_features_to_multiple_of", self.pad_out_features_to_multiple_of
            )


@dataclass(kw_only=True)
class RowwiseParallel:
    """nn.Linear -> RowParallelLinear (input split by features, output reduced)."""

    input_is_parallel: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "input_is_parallel")


@dataclass(kw_only=True)
class VocabParallel:
    """nn.Embedding -> VocabParallelEmbedding. reduce_scatter: whether its output is reduce-scattered along
    the sequence (None: under sequence parallelism); False keeps it whole for a model that adds to it (a
    position embedding) before it splits the sequence itself."""

    pad_vocab_to_multiple_of: int = 1
    reduce_scatter: bool | None = None

    def __post_init__(self) -> None:
        check_positive_int("VocabParallel.pad_vocab_to_multiple_of", self.pad_vocab_to_multiple_of)
        if self.reduce_scatter is not None:
            _check_bool(self, "reduce_scatter")


@dataclass(kw_only=True)
class SequenceParallel:
    """A norm (or any per-token module with replicated parameters) that runs on sequence shards: its
    parameters are marked for allreduce_sequence_parallel_grads. Needs sequence_parallel=True."""


@dataclass(kw_only=True)
class DropoutParallel:
    """nn.Dropout -> TrackedDropout drawing from a TP-aware stream (nn.Dropout would draw from the
    process-wide generator that all rank threads share, so TP ranks would disagree on replicated masks).

    in_tp_region=True ("tp_dropout"): the activation is split across the TP ranks (attention probabilities
    over this rank's heads): a different mask on each rank. False ("dropout"): outside the TP region, where
    the activation is replicated (one mask for the TP group) or, under sequence parallelism, split along the
    sequence (a mask per rank)."""

    in_tp_region: bool = False

    def __post_init__(self) -> None:
        _check_bool(self, "in_tp_region")


Style = ColwiseParallel | RowwiseParallel | VocabParallel | SequenceParallel | DropoutParallel
STYLES: dict[str, Callable[[], Style]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "vocab": VocabParallel,
    "sequence": SequenceParallel,
    "dropout": DropoutParallel,
    "tp_dropout": lambda: DropoutParallel(in_tp_region=True),
}
_NEEDS = {
    ColwiseParallel: nn.Linear,
    RowwiseParallel: nn.Linear,
    VocabParallel: nn.Embedding,
    DropoutParallel: nn.Dropout,
}


def _parse_style(pattern: str, style: object) -> Style:
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]()
    if isinstance(
        style, (ColwiseParallel, RowwiseParallel, VocabParallel, SequenceParallel, DropoutParallel)
    ):
        return style
    raise ConfigError(
        f"parallelize_plan entry {pattern!r}: {style!r} is not a style; use one of {sorted(STYLES)} or a "
        "ColwiseParallel / RowwiseParallel / VocabParallel / SequenceParallel / DropoutParallel object"
    )


def _assign(
    module: nn.Module, parallelize_plan: Mapping[str, object], sequence_parallel: bool
) -> dict[str, Style]:
    """Module name -> style, checking that every pattern matches and each module gets one style."""
    if not isinstance(parallelize_plan, Mapping) or not parallelize_plan:
        raise ConfigError("parallelize_plan must be a non-empty dict of module-name patterns to styles")
    modules = dict(module.named_modules())
    assigned: dict[str, tuple[str, Style]] = {}
    for pattern, raw in parallelize_plan.items():
        style = _parse_style(pattern, raw)
        if isinstance(style, SequenceParallel) and not sequence_parallel:
            raise ConfigError(
                f"parallelize_plan entry {pattern!r} is 'sequence', which marks norms running on sequence shards; "
                "pass sequence_parallel=True, or drop the entry"
            )
        matches = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            some = ", ".join(list(n for n in modules if n)[:12])
            raise ConfigError(
                f"parallelize_plan entry {pattern!r} matches no module; module names are like: {some}"
            )
        for name in matches:
            need = _NEEDS.get(type(style))
            if need is not None and type(modules[name]) is not need:
                raise ConfigError(
                    f"parallelize_plan entry {pattern!r} -> {type(style).__name__} matched '{name}', a "
                    f"{type(modules[name]).__name__}; it applies to {need.__name__} only (narrow the pattern)"
                )
            if name in assigned and assigned[name][1] != style:
                raise ConfigError(
                    f"module '{name}' is matched by {assigned[name][0]!r} and {pattern!r} with different styles"
                )
            assigned[name] = (pattern, style)
    for name, sub in modules.items():
        if type(sub) is nn.Dropout and sub.p > 0 and name not in assigned:
            raise ConfigError(
                f"module '{name}' is an nn.Dropout(p={sub.p}) the parallelize_plan does not cover; on rank threads it "
                "would draw from the process-wide generator and the TP ranks would disagree on its mask. "
                "Add it to the parallelize_plan as 'dropout' (outside the TP region) or 'tp_dropout' (on split activations)"
            )
    return {name: style for name, (_, style) in assigned.items()}


def _tied_weights(module: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) sharing one Parameter."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for param_name, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((mod_name, param_name))
    return [group for group in owners.values() if len(group) > 1]


def parallelize(
    module: nn.Module,
    parallelize_plan: Mapping[str, str | Style],
    *,
    group: ProcessGroup | str | None = None,
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
    overlap_grad_comm: bool | None = None,
) -> nn.Module:
    """Swap the modules `parallelize_plan` names for tensor-parallel layers holding this rank's shards (in place);
    return `module`. With sequence_parallel=True the embedding reduce-scatters along `sequence_dim`,
    column layers all-gather their input and row layers reduce-scatter their output.
    `overlap_grad_comm`: the column layers' option (their backward overlaps the input-gradient
    collective with the weight-gradient GEMM; None: where it helps)."""
    group = resolve_tp_group(group)
    overlap_grad_comm = resolve_overlap(overlap_grad_comm, group)
    assigned = _assign(module, parallelize_plan, bool(sequence_parallel))
    ties = _tied_weights(module)
    # A head tied to a padded vocabulary embedding must be padded the same way to share its weight.
    for tie in ties:
        vocab = [v for m, _ in tie if isinstance(v := assigned.get(m), VocabParallel)]
        for mod_name, _ in tie:
            style = assigned.get(mod_name)
            if vocab and isinstance(style, ColwiseParallel) and style.pad_out_features_to_multiple_of is None:
                pad = vocab[0].pad_vocab_to_multiple_of
                assigned[mod_name] = dataclasses.replace(style, pad_out_features_to_multiple_of=pad)

    for name, style in assigned.items():
        old = module.get_submodule(name)
        if isinstance(style, SequenceParallel):
            mark_sequence_parallel(old)  # stays as it is; its gradients get summed over the TP group
            continue
        new = _build(old, style, group, bool(sequence_parallel), sequence_dim, overlap_grad_comm)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, new)

    for tie in ties:
        _retie(module, tie, assigned)
    return module


def _build(
    old: nn.Module, style: Style, group: ProcessGroup, sp: bool, sequence_dim: int, overlap: bool
) -> nn.Module:
    """The replacement of `old`, holding this rank's shard of its weights."""
    common = {"group": group, "sequence_dim": sequence_dim}
    # _assign matched each style only to its module type (_NEEDS); SequenceParallel is never built.
    if isinstance(style, ColwiseParallel):
        assert isinstance(old, nn.Linear)
        return ColumnParallelLinear.from_dense(
            old,
            gather_output=style.gather_output,
            input_is_parallel=style.input_is_parallel,
            stride=style.stride,
            pad_out_features_to_multiple_of=style.pad_out_features_to_multiple_of,
            sequence_parallel=sp,
            overlap_grad_comm=overlap,
            **common,
        )
    if isinstance(style, RowwiseParallel):
        assert isinstance(old, nn.Linear)
        return RowParallelLinear.from_dense(
            old, input_is_parallel=style.input_is_parallel, sequence_parallel=sp, **common
        )
    if isinstance(style, VocabParallel):
        assert isinstance(old, nn.Embedding)
        pad = style.pad_vocab_to_multiple_of
        scatter = sp if style.reduce_scatter is None else style.reduce_scatter
        return VocabParallelEmbedding.from_dense(
            old, pad_vocab_to_multiple_of=pad, reduce_scatter_embeddings=scatter, **common
        )
    assert isinstance(old, nn.Dropout) and not isinstance(style, SequenceParallel)
    # Dropout. Under SP, activations outside the TP region are sequence shards: each rank needs its own mask.
    new = TrackedDropout(old.p, in_tp_region=style.in_tp_region or sp)
    return new.train(old.training)


def _retie(module: nn.Module, tie: list[tuple[str, str]], assigned: dict[str, Style]) -> None:
    swapped = [
        m for m, _ in tie if isinstance(assigned.get(m), (ColwiseParallel, RowwiseParallel, VocabParallel))
    ]
    if not swapped:
        return
    if len(swapped) != len(tie):
        kept = [m for m, _ in tie if m not in swapped]
        raise ConfigError(
            f"modules {swapped} and {kept} share a weight, but the parallelize_plan shards only the first; "
            "give the tied modules matching styles (e.g. 'vocab' for the embedding and 'colwise' for the head)"
        )
    first_module, first_name = module.get_submodule(tie[0][0]), tie[0][1]
    assert isinstance(first_module, TensorParallelModule)  # swapped: all of them are TP layers now
    first, first_spec = getattr(first_module, first_name), first_module.shard_specs.get(first_name)
    for mod_name, param_name in tie[1:]:
        sub = module.get_submodule(mod_name)
        assert isinstance(sub, TensorParallelModule)
        other, spec = getattr(sub, param_name), sub.shard_specs.get(param_name)
        if other.shape != first.shape or spec != first_spec:
            raise ConfigError(
                f"'{tie[0][0]}.{first_name}' and '{mod_name}.{param_name}' are tied, but are split differently "
                f"({first_spec}, local {list(first.shape)} vs {spec}, local {list(other.shape)}); "
                "shard them the same way"
            )
        setattr(sub, param_name, first)
