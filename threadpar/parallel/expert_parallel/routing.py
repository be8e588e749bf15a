"""Routing: the top-k router with its load-balancing loss, and which assignments each expert keeps.

Every token t picks its top_k experts; (t, slot) is an *assignment*, numbered a = t * top_k + slot. The
dispatcher works on assignments sorted by expert: `assign` returns that order with over-capacity
assignments left out, in vectorised form (no Python loop over tokens or experts); `assign_slots` puts the
same kept assignments, in the same order, into a fixed [E, capacity] table of slots (MoEConfig's
pad_to_capacity), with nothing read on the host.

Counts per expert come from scatter_add, not torch.bincount: bincount on CUDA reads the input's maximum
on the host to size its output (aten/src/ATen/native/cuda/SummaryOps.cu), which a CUDA graph refuses.
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


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of `experts` (any shape, expert ids) name each expert; no host read."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )


def load_balancing_loss(
    probs: torch.Tensor,
    routed: torch.Tensor,
    top_k: int,
    coeff: float,
    num_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """coeff * E * sum_e f_e * P_e, f_e = routed_e / (N * k), P_e = mean over tokens of probs[:, e]
    (Megatron's switch_load_balancing_loss_func); equals coeff when routing is uniform.

    When a sequence's tokens are split over ranks, pass the whole routed counts and token count N: each
    rank's value is then its tokens' share, and the shares sum to the loss of the whole sequence. N may be
    a device tensor (an all-reduced count, not read on the host)."""
    e = probs.shape[1]
    weighted = probs.sum(0).mul(routed.to(probs.dtype)).sum()
    if isinstance(num_tokens, torch.Tensor):  # (in float64, then rounded once, as the Python float would be)
        total = num_tokens.to(torch.float64).clamp(min=1)  # no tokens: the sum is 0
        return weighted * ((coeff * e) / (top_k * total * total)).to(probs.dtype)
    n = max(1, probs.shape[0] if num_tokens is None else num_tokens)
    return weighted * (coeff * e / (top_k * n * n))


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
        routed = expert_counts(experts, cfg.num_experts)
        counts: torch.Tensor = routed
        num_tokens: int | torch.Tensor = probs.shape[0]
        if self.aux_loss_group is not None and cfg.aux_loss_coeff > 0:
            # (new_full: a fill on the device, where new_tensor([n]) would copy from host memory)
            counts = torch.cat([routed, routed.new_full((1,), probs.shape[0])])
            self.aux_loss_group.all_reduce(counts)
            # The group's token count stays on the device: reading it would be a host read per forward.
            counts, num_tokens = counts[:-1], counts[-1]
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


def priority_order(experts: torch.Tensor, gates: torch.Tensor, policy: str) -> torch.Tensor:
    """[N * k] every assignment, sorted by expert; within an expert in priority order: highest gate first
    ("probs") or earliest token first ("position"). (Sorts only: fixed shapes, no host read.)"""
    flat = experts.flatten()  # [N * k]
    if policy == "probs":
        by_gate = torch.argsort(gates.detach().flatten(), descending=True, stable=True)
        return by_gate[torch.argsort(flat[by_gate], stable=True)]
    return torch.argsort(flat, stable=True)  # position: a = t * k + slot grows with the token


def assign(
    experts: torch.Tensor, gates: torch.Tensor, num_experts: int, capacity: int | None, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, kept): the kept assignments sorted by expert [M] (ids a = t * k + slot), and how many each
    expert keeps [E]. Within an expert, assignments come in priority order (`priority_order`); an expert
    keeps its first `capacity` of them. M depends on the routing (a shape read on the host)."""
    flat = experts.flatten()  # [N * k]
    order = priority_order(experts, gates, policy)
    routed = expert_counts(flat, num_experts)
    if capacity is None or capacity >= int(routed.max()):
        return order, routed
    starts = routed.cumsum(0) - routed  # [E] where each expert's assignments begin in `order`
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
    return order[rank_in_expert < capacity], routed.clamp(max=capacity)


def assign_slots(
    experts: torch.Tensor, gates: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, kept): slots [E, capacity] int64, expert e's kept assignments (ids a = t * k + slot) in its
    first kept[e] slots, in `assign`'s order, and the id N * k (one past the last assignment: a dummy) in
    the empty ones; kept [E] as `assign` returns it. Shapes from N, k, E and capacity only; nothing read
    on the host (Megatron's drop-and-pad: moe_utils.apply_router_token_dropping with pad_to_capacity)."""
    flat = experts.flatten()  # [N * k]
    order = priority_order(experts, gates, policy)
    routed = expert_counts(flat, num_experts)
    kept = routed.clamp(max=capacity)
    # Slot (e, c) holds the c-th of expert e's assignments in `order`, which begins at starts[e]: a gather
    # (a scatter of the kept ones would need the dropped ones' writes sent somewhere).
    starts = routed.cumsum(0) - routed  # [E]
    column = torch.arange(capacity, device=flat.device)  # [C]
    at = (starts.unsqueeze(1) + column).clamp(max=max(flat.numel() - 1, 0))  # [E, C] (clamped: empty ones)
    taken = order[at] if flat.numel() else at  # (no assignments: every slot is empty, C = 0)
    return taken.masked_fill(column >= kept.unsqueeze(1), flat.numel()), kept
