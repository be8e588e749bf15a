"""Pure gradient-bucket assignment (no torch, no threads): which parameters share one all-reduce.

Parameters are visited in an order (reverse registration order at first, which is roughly the order in
which backward produces their gradients; after the first iteration, the order it actually did) and packed
into buckets of at most one (device, dtype) key each. As in torch's `_compute_bucket_assignment_by_size`
and InfiniTrain's `ComputeBucketAssignmentBySize`, a bucket closes as soon as it holds at least its cap,
so a bucket may exceed its cap by its last tensor, and a tensor larger than the cap fills a bucket alone.
The caps are a list: the first bucket of each key uses the first cap (small, so the first all-reduce
starts early in backward), later ones the next, and so on; the last cap repeats.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """What the assignment needs to know about one gradient."""

    nbytes: int
    key: Hashable = None  # tensors with different keys (device, dtype) never share a bucket


@dataclass
class _OpenBucket:
    level: int  # index into the list of caps
    indices: list[int] = field(default_factory=list)
    nbytes: int = 0


def caps_in_bytes(first_bucket_cap_mb: float, bucket_cap_mb: float) -> list[int]:
    """The cap list for DDP's two options (MiB, as torch's bucket_cap_mb)."""
    return [int(first_bucket_cap_mb * MIB), int(bucket_cap_mb * MIB)]


def check_order(order: Sequence[int], n: int) -> list[int]:
    """`order` as a list, or ValueError unless it is a permutation of range(n)."""
    order = list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {order}")
    return order


def assign_buckets(
    specs: Sequence[TensorSpec], caps: Sequence[int], order: Sequence[int] | None = None
) -> list[list[int]]:
    """Bucket the tensors `specs` (indices into it), visiting them in `order` (default: reversed).

    Returns the buckets in launch order (sorted by where their first tensor comes in `order`); within a
    bucket, tensors keep the visiting order. Every index appears in exactly one bucket.
    """
    if not caps or any(c < 0 for c in caps):
        raise ValueError(f"caps must be a non-empty list of non-negative byte counts, got {list(caps)}")
    n = len(specs)
    order = list(range(n - 1, -1, -1)) if order is None else check_order(order, n)
    open_buckets: dict[Hashable, _OpenBucket] = {}
    closed: list[list[int]] = []
    for index in order:
        spec = specs[index]
        bucket = open_buckets.setdefault(spec.key, _OpenBucket(level=0))
        bucket.indices.append(index)
        bucket.nbytes += spec.nbytes
        if bucket.nbytes >= caps[min(bucket.level, len(caps) - 1)]:
            closed.append(bucket.indices)
            open_buckets[spec.key] = _OpenBucket(level=bucket.level + 1)
    closed += [b.indices for b in open_buckets.values() if b.indices]
    position = {index: p for p, index in enumerate(order)}
    closed.sort(key=lambda indices: position[indices[0]])
    return closed


def rebuild_order(ready: Sequence[int], previous: Sequence[int], n: int) -> list[int]:
    """The visiting order for a rebuild: tensors in the order their gradients became ready, then the ones
    that never did (unused this iteration) in their previous order, so they sit in the last buckets."""
    seen = set(ready)
    if len(seen) != len(ready) or any(not 0 <= i < n for i in ready):
        raise ValueError(f"ready must list distinct indices in range({n}), got {list(ready)}")
    return list(ready) + [i for i in check_order(previous, n) if i not in seen]
