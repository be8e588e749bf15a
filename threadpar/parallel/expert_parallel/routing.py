"""Routing: the top-k router with its load-balancing loss, and which assignments each expert keeps.

Every token t picks its top_k experts; (t, slot) is an *assignment*, numbered a = t * top_k + slot. The
dispatcher works on assignments sorted by expert: `assign` returns that order with over-capacity
assignments left out, in vectorised form (no Python loop over tokens or experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from threadpar.parallel.expert_parallel.config import MoEConfig


@dataclass
class Routing:
    """One forward's routing of N tokens: probs [N, E] float32 (softmax over all experts), gates [N, k]
    (the weights of the chosen experts' outputs), experts [N, k] int64, aux_loss (scalar, times coeff),
    routed [E] int64 (assignments per expert before dropping)."""

    probs: torch.Tensor
    gates: torch.Tensor
    experts: torch.Tensor
    aux_loss: torch.Tensor
    routed: torch.Tensor


def load_balancing_loss(probs: torch.Tensor, routed: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """coeff * E * sum_e f_e * P_e, f_e = routed_e / (N * k), P_e = mean over tokens of probs[:, e]
    (Megatron's switch_load_balancing_loss_func); equals coeff when routing is uniform."""
    n, e = probs.shape
    return probs.sum(0).mul(routed.to(probs.dtype)).sum() * (coeff * e / (top_k * n * n))


class TopKRouter(nn.Module):
    """Linear gate [E, hidden] (no bias), softmax in float32, top-k; replicated on every rank."""

    def __init__(self, config: MoEConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, device=device, dtype=dtype)
        )

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """nn.Linear's initialisation, drawn from `generator` (None: the process-wide RNG)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=generator)

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        logits = F.linear(x.float(), self.weight.float())  # [N, E]
        probs = logits.softmax(dim=-1)
        gates, experts = probs.topk(cfg.top_k, dim=-1)  # [N, k] each, best first
        if cfg.normalize_top_k and cfg.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        routed = torch.bincount(experts.flatten(), minlength=cfg.num_experts)
        aux = load_balancing_loss(probs, routed, cfg.top_k, cfg.aux_loss_coeff)
        return Routing(probs, gates, experts, aux, routed)


def expert_capacity(
    num_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None
) -> int | None:
    """The most assignments one expert keeps from a forward of `num_tokens` tokens (Megatron's
    get_capacity: ceil(tokens * top_k / experts * factor)); None without a capacity factor."""
    if capacity_factor is None:
        return None
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def assign(
    experts: torch.Tensor, gates: torch.Tensor, num_experts: int, capacity: int | None, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, kept): the kept assignments sorted by expert [M] (ids a = t * k + slot), and how many each
    expert keeps [E]. Within an expert, assignments come in priority order: highest gate first ("probs")
    or earliest token first ("position"); an expert keeps its first `capacity` of them."""
    flat = experts.flatten()  # [N * k]
    if policy == "probs":
        by_gate = torch.argsort(gates.detach().flatten(), descending=True, stable=True)
        order = by_gate[torch.argsort(flat[by_gate], stable=True)]
    else:  # position: a = t * k + slot grows with the token
        order = torch.argsort(flat, stable=True)
    routed = torch.bincount(flat, minlength=num_experts)
    if capacity is None or capacity >= int(routed.max()):
        return order, routed
    starts = routed.cumsum(0) - routed  # [E] where each expert's assignments begin in `order`
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
    return order[rank_in_expert < capacity], routed.clamp(max=capacity)
