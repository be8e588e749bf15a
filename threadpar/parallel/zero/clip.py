"""Global gradient clipping over the distributed optimizer's shards.

Each element of the model's reduced gradient lives in exactly one DP rank's shard (ZeRO-2 keeps only that;
under ZeRO-1 the shard's pieces are what the step reads), so the DP copies of a gradient are gone: a piece
counts wherever it is, and only model-parallel copies (a LayerNorm weight on every TP rank) still count
once. The norm is then clip_grad's: |g|^p of the counted pieces summed over the launch, and the pieces
scaled in place by the clip coefficient before the step uses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from threadpar.parallel.clip_grad import grad_placements, scale_grads_by_norm_, total_grad_norm


def clip_shard_grad_norm_(
    pieces: Sequence[tuple[torch.nn.Parameter, torch.Tensor]],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The whole model's gradient norm from this rank's shards, given as (parameter, its gradient piece) pairs
    (ZeroRedundancyOptimizer.shard_gradient_pieces); a collective over the launch: every rank calls it. The
    pieces are clipped to max_norm in place (max_norm=inf: only measured)."""
    params, grads = [p for p, _ in pieces], [g for _, g in pieces]
    placements = [p.sharded_over_data_parallel() for p in grad_placements(params)] if params else []
    total = total_grad_norm(
        grads, placements, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
    )
    if not math.isinf(float(max_norm)):
        scale_grads_by_norm_(grads, max_norm, total, foreach)
    return total
