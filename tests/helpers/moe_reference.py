"""A naive mixture-of-experts, written for clarity rather than speed: the oracle of the MoE tests.

Token by token and expert by expert (Python loops), from the dense parameters of a MoE layer: softmax
router, top-k, optional renormalisation, capacity per expert decided by priority (highest probability, or
earliest token), each kept assignment's expert MLP times its gate, and the load-balancing loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def naive_moe(x, params, *, num_experts, top_k, capacity_factor=None, drop_policy="probs",
              aux_loss_coeff=0.01, normalize_top_k=True, activation=F.gelu):  # fmt: skip
    """x [N, hidden]; params: the dense state dict of a MoE layer -> (y [N, hidden], aux_loss)."""
    n = x.shape[0]
    probs = F.linear(x.float(), params["router.weight"].float()).softmax(-1)  # [N, E]
    choices = []  # per token: [(expert, gate)]
    for t in range(n):
        gates, experts = probs[t].topk(top_k)
        if normalize_top_k and top_k > 1:
            gates = gates / gates.sum()
        choices.append(list(zip(experts.tolist(), gates)))
    capacity = None if capacity_factor is None else math.ceil(n * top_k / num_experts * capacity_factor)
    kept = set()
    for e in range(num_experts):
        mine = [(t, gate) for t in range(n) for ex, gate in choices[t] if ex == e]
        if drop_policy == "probs":
            mine.sort(key=lambda tg: -tg[1].item())  # sort is stable: ties keep token order
        for t, _ in mine[: len(mine) if capacity is None else capacity]:
            kept.add((t, e))
    rows = []
    for t in range(n):
        row = torch.zeros_like(x[t])
        for e, gate in choices[t]:
            if (t, e) in kept:
                h = x[t] @ params["experts.fc1_weight"][e] + params["experts.fc1_bias"][e]
                out = activation(h) @ params["experts.fc2_weight"][e] + params["experts.fc2_bias"][e]
                row = row + gate.to(x.dtype) * out
        rows.append(row)
    routed = torch.zeros(num_experts)
    for t in range(n):
        for e, _ in choices[t]:
            routed[e] += 1
    aux = (
        aux_loss_coeff
        * num_experts
        * sum((routed[e] / (n * top_k)) * probs[:, e].mean() for e in range(num_experts))
    )
    return torch.stack(rows), aux, len(kept)
