"""The configuration of a mixture-of-experts (MoE) layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from threadpar.errors import ConfigError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
DROP_POLICIES = ("probs", "position")


@dataclass(kw_only=True)
class MoEConfig:
    """A MoE layer: `num_experts` MLPs (hidden_size -> ffn_hidden_size -> hidden_size), each token sent to
    its `top_k` experts by a learned router.

    capacity_factor: None is dropless (every routed token is computed). Otherwise each expert takes at
        most ceil(capacity_factor * tokens * top_k / num_experts) of a forward's tokens; the rest of its
        assignments are dropped (their share of the output is zero; the residual carries the token).
    drop_policy: which assignments an expert over capacity keeps: "probs", the highest router
        probabilities (Megatron's default), or "position", the earliest tokens.
    aux_loss_coeff: weight of the load-balancing loss coeff * E * sum_e f_e * P_e (Switch Transformer /
        Megatron: f_e the fraction of assignments routed to expert e, P_e its mean router probability).
    normalize_top_k: rescale each token's top-k probabilities to sum to 1 (Megatron's default for k > 1).
    pad_to_capacity: every expert gets exactly `capacity` rows per forward, the empty ones padded (zero
        rows of gate 0), so no shape and no all-to-all split depends on the routing and the forward reads
        nothing on the host: what a CUDA graph (threadpar.graphed_step) can hold. Needs capacity_factor;
        computes what the unpadded layer with that capacity computes (Megatron's
        --moe-pad-expert-input-to-capacity). The capacity comes from the forward's token count, so every
        rank of an EP group must route as many tokens.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    aux_loss_coeff: float = 1e-2
    normalize_top_k: bool = True
    activation: str = "gelu"
    bias: bool = True
    pad_to_capacity: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"MoEConfig.top_k={self.top_k} is more than num_experts={self.num_experts}; pick top_k <= num_experts"
            )
        if self.capacity_factor is not None and (
            not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0
        ):
            raise ConfigError(
                f"MoEConfig.capacity_factor must be a positive number (or None for no dropping), "
                f"got {self.capacity_factor!r}"
            )
        if not isinstance(self.pad_to_capacity, bool):
            raise ConfigError(f"MoEConfig.pad_to_capacity must be a bool, got {self.pad_to_capacity!r}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError(
                "MoEConfig.pad_to_capacity=True needs a capacity_factor: each expert's fixed number of rows is "
                "ceil(capacity_factor * tokens * top_k / num_experts). Set capacity_factor (1.0 for example), "
                "or pad_to_capacity=False for dropless routing (which a CUDA graph cannot hold)"
            )
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(
                f"MoEConfig.drop_policy must be one of {', '.join(DROP_POLICIES)}, got {self.drop_policy!r}"
            )
        if not isinstance(self.aux_loss_coeff, (int, float)) or self.aux_loss_coeff < 0:
            raise ConfigError(f"MoEConfig.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff!r}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"MoEConfig.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
