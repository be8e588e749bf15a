"""How a sequence is laid out over a context-parallel (CP) group: padding, the load-balanced split, gathering.

Causal attention is lopsided: a query late in the sequence attends to many more keys than an early one.
So the sequence is cut into 2 * cp equal chunks and CP rank r holds chunks r and 2cp - 1 - r (one from
each end), concatenated in that order. Every rank then does the same causal work, and its local tokens
stay in increasing position order, so a local causal mask is still right within them.

    T = 8, cp = 2:  chunks 0 1 2 3  ->  rank 0 holds [0, 3], rank 1 holds [1, 2]
    positions:      rank 0: 0 1 6 7    rank 1: 2 3 4 5

The sequence must split into 2 * cp chunks (and, with sequence parallelism inside each CP rank, each
rank's part into tp pieces): `get_padding` says how many positions to append, as Megatron's does.
"""

from __future__ import annotations

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.groups import resolve_group
from threadpar.parallel.tensor_parallel.collectives import all_gather_along_dim, normalize_dim


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def padding_multiple(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple the sequence length must have: 2 * cp (two chunks per CP rank), times tp under
    sequence parallelism (each CP rank's part splits over its TP group)."""
    _positive_int("cp_size", cp_size)
    _positive_int("tp_size", tp_size)
    multiple = 2 * cp_size if cp_size > 1 else 1
    return multiple * (tp_size if sequence_parallel else 1)


def get_padding(seq_len: int, cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """How many positions to append to a sequence of `seq_len` so CP (and SP) can split it (Megatron's
    get_padding). Append them at the end: under causal attention no real token attends to them; give
    their targets the loss's ignore_index."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 0:
        raise ConfigError(f"seq_len must be a non-negative int, got {seq_len!r}")
    multiple = padding_multiple(cp_size, tp_size, sequence_parallel)
    return -seq_len % multiple


def pad_sequence(x: torch.Tensor, padding: int, dim: int = 1, value: float = 0) -> torch.Tensor:
    """`x` with `padding` entries of `value` appended along `dim` (token ids, targets, activations)."""
    if padding == 0:
        return x
    dim = normalize_dim(dim, x.dim())
    shape = list(x.shape)
    shape[dim] = padding
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp_size) that CP rank `cp_rank` holds: one from each end."""
    _positive_int("cp_size", cp_size)
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ConfigError(f"cp_rank must be in 0..{cp_size - 1}, got {cp_rank!r}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_len(seq_len: int, cp_size: int) -> int:
    if seq_len % (2 * cp_size):
        raise ConfigError(
            f"a sequence of {seq_len} positions does not split into 2 * cp = {2 * cp_size} equal chunks; "
            f"pad it with get_padding(seq_len, cp_size={cp_size}) more positions (pad_sequence)"
        )
    return seq_len // (2 * cp_size)


def load_balanced_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions CP rank `cp_rank` holds, in its local order: [seq_len / cp_size] int64.
    Use them for position embeddings (and to pick the matching targets)."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    n = _chunk_len(seq_len, cp_size)
    first, second = load_balanced_chunks(cp_size, cp_rank)
    return torch.cat(
        [
            torch.arange(first * n, (first + 1) * n, device=device),
            torch.arange(second * n, (second + 1) * n, device=device),
        ]
    )


def split_sequence(x: torch.Tensor, dim: int = 1, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """This CP rank's part of the whole sequence `x` along `dim`: its two chunks, concatenated (a new,
    contiguous tensor; differentiable). `group=None` is this rank's CP group."""
    group = resolve_group(group, "CP")
    cp = group.size()
    if cp == 1:
        return x
    dim = normalize_dim(dim, x.dim())
    n = _chunk_len(x.shape[dim], cp)
    first, second = load_balanced_chunks(cp, group.rank())
    return torch.cat([x.narrow(dim, first * n, n), x.narrow(dim, second * n, n)], dim=dim)


def _natural_order(cp: int) -> torch.Tensor:
    """For chunk j of the whole sequence, its index among the gathered chunks [r0a, r0b, r1a, r1b, ...]."""
    return torch.tensor([2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)])


def restore_sequence_order(gathered: torch.Tensor, cp_size: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the CP ranks' parts concatenated in rank order along `dim`."""
    if cp_size == 1:
        return gathered
    dim = normalize_dim(dim, gathered.dim())
    n = _chunk_len(gathered.shape[dim], cp_size)
    chunks = gathered.unflatten(dim, (2 * cp_size, n))  # [..., 2cp, n, ...]
    order = _natural_order(cp_size).to(gathered.device)
    return chunks.index_select(dim, order).flatten(dim, dim + 1)


def gather_sequence(x: torch.Tensor, dim: int = 1, group: ProcessGroup | str | None = None) -> torch.Tensor:
    """The whole sequence, in position order, from every CP rank's part (a collective; no autograd):
    for evaluation, logging and tests."""
    group = resolve_group(group, "CP")
    if group.size() == 1:
        return x
    return restore_sequence_order(all_gather_along_dim(x.detach(), dim, group), group.size(), dim)
