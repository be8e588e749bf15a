"""Global gradient clipping over every parallel axis: `clip_grad_norm_` (norm.py) and the placement markers
it reads (placement.py). Import them from `threadpar.parallel`."""
