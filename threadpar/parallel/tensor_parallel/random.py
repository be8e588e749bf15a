"""Random streams for tensor parallelism: which ranks share a dropout mask, and weight init.

torch.nn.functional.dropout draws from the process-wide default generator, which all rank threads share
(DESIGN.md rule 3), and Megatron's trick of swapping that generator's state per region is not
thread-safe. So each rank has an RNGTracker of named torch.Generators, and TrackedDropout draws its
mask from one of them explicitly:

- TP_REGION: seeded with the TP rank. Inside the TP region (attention probabilities over this rank's
  heads, an MLP's sharded hidden, or any activation split along the sequence under sequence parallelism)
  ranks hold different parts of the activation, so their masks must differ. Identical across DP replicas.
- REPLICATED: shared by the TP group, for activations every TP rank holds whole (it would be wrong for
  them to disagree: the replicas of the activation would diverge).
- INIT: shared by the TP group; TP layers draw their dense initial weights from it and keep their shard,
  so a TP model starts as the dense model split, whatever the TP size.

Every stream is also keyed by the pipeline stage, and all but INIT by the context-parallel rank
(CP ranks hold replicas of one model, so they initialise it alike, but different tokens). Seeds derive from
`launch(seed=...)`, so runs repeat. Generators live on the rank's device.
"""

from __future__ import annotations

import torch
from torch import nn

from threadpar.errors import ConfigError
from threadpar.runtime.context import current
from threadpar.runtime.rng_tracker import INIT, REPLICATED, TP_REGION, RNGTracker

__all__ = ["INIT", "REPLICATED", "TP_REGION", "RNGTracker", "TrackedDropout", "dropout", "get_rng_tracker"]


def get_rng_tracker() -> RNGTracker:
    """This rank's tracker (inside a launched rank thread): `RankContext.rng_tracker`."""
    return current().rng_tracker


def dropout(x: torch.Tensor, p: float, generator: torch.Generator, training: bool = True) -> torch.Tensor:
    """Inverted dropout whose mask comes from `generator` (on x's device)."""
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p  # bool mask: 1 byte per element
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - p))


class TrackedDropout(nn.Module):
    """nn.Dropout drawing its mask from this rank's RNG tracker: the TP_REGION stream (`in_tp_region=True`)
    or the REPLICATED stream. (The module; the `parallelize_plan` entry that installs it is DropoutParallel.)

    Use in_tp_region=True where TP ranks hold different parts of the activation: after attention softmax
    over a rank's heads, and on activations split along the sequence under sequence parallelism.
    """

    def __init__(self, p: float = 0.5, *, in_tp_region: bool = False) -> None:
        super().__init__()
        if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"dropout probability must be between 0 and 1, got {p!r}")
        self.p = float(p)
        self.in_tp_region = bool(in_tp_region)
        # Captured now, on the rank thread: forward may run where there is no rank context.
        self.generator = get_rng_tracker().generator(TP_REGION if in_tp_region else REPLICATED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.generator, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, in_tp_region={self.in_tp_region}"
