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

from threadpar.comm.group import ProcessGroup
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


def load_balancing_loss(
    probs: torch.Tensor, routed: torch.Tensor, top_k: int, coeff: float, num_tokens: int | None = None
) -> torch.Tensor:
    """coeff * E * sum_e f_e * P_e, f_e = routed_e / (N * k), P_e = mean over tokens of probs[:, e]
    (Megatron's switch_load_balancing_loss_func); equals coeff when routing is uniform.

    When a sequence's tokens are split over ranks, pass the whole routed counts and token count N: each
    rank's value is then its tokens' share, and the shares sum to the loss of the whole sequence."""
    n = max(1, probs.shape[0] if num_tokens is None else num_tokens)  # no tokens: the sum is 0
    e = probs.shape[1]
    return probs.sum(0).mul(routed.to(probs.dtype)).sum() * (coeff * e / (top_k * n * n))


class TopKRouter(nn.Module):
    """Linear gate [E, hidden] (no bias), softmax in float32, top-k; replicated on every rank.

    aux_loss_group: the ranks that hold other tokens of the same sequences (the CP group, or the TP group
    under sequence parallelism): the load-balancing loss then counts routing over all of them (one
    all-reduce of E + 1 integers), as the loss of the unsplit sequence would. None: this rank's tokens.
    """

    def __init__(
        self, config: MoEConfig, device=None, dtype=None, aux_loss_group: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.aux_loss_group = (
            aux_loss_group if aux_loss_group is not None and aux_loss_group.size() > 1 else None
        )
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
        counts, num_tokens = routed, probs.shape[0]
        if self.aux_loss_group is not None and cfg.aux_loss_coeff > 0:
            counts = torch.cat([routed, routed.new_tensor([num_tokens])])
            self.aux_loss_group.all_reduce(counts)
            counts, num_tokens = counts[:-1], int(counts[-1])
        aux = load_balancing_loss(probs, counts, cfg.top_k, cfg.aux_loss_coeff, num_tokens)
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
