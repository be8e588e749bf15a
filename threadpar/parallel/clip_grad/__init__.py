"""Global gradient clipping over every parallel axis: `clip_grad_norm_` (norm.py) and the placement markers
it reads (placement.py)."""

from threadpar.parallel.clip_grad.norm import clip_grad_norm_, scale_grads_by_norm_, total_grad_norm
from threadpar.parallel.clip_grad.placement import (
    grad_placements,
    mark_grad_placement,
    mark_grad_placements,
)
from threadpar.parallel.records import GradPlacement

__all__ = [
    "GradPlacement",
    "clip_grad_norm_",
    "grad_placements",
    "mark_grad_placement",
    "mark_grad_placements",
    "scale_grads_by_norm_",
    "total_grad_norm",
]
