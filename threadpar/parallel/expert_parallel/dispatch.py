"""Token dispatch over an expert-parallel group: all-to-all to the experts' ranks and back.

The tokens arrive sorted by expert (routing.assign). Expert e lives on EP rank e // E_local, so the rows
for rank j are one contiguous block: one all_to_all_single with split sizes sends each block to its rank
(Megatron's all-to-all token dispatcher), after a tiny all-to-all of the per-expert counts tells every
rank how many rows it will get from whom. A rank receives its rows ordered (source rank, local expert),
regroups them by local expert for the batched experts, and the reverse path undoes both steps; the
second all-to-all ("combine") returns every output row to the rank its token came from.

    dispatch: tokens [M, hidden] (sorted by expert) -> all-to-all -> [R, hidden] by (source, expert)
              -> regroup -> [R, hidden] by (expert, source) -> experts
    combine:  outputs -> un-group -> all-to-all (splits swapped) -> [M, hidden] in the order sent

Only rows that are routed, and kept under the capacity, travel: no padding to capacity on the wire.
Padded to capacity (MoEConfig.pad_to_capacity, `AllToAllDispatcher.padded`) every expert has C rows from
every rank, so the splits are equal and known from shapes: no counts exchanged, nothing read on the host,
what a CUDA graph can hold (Megatron's MoEAlltoAllTokenDispatcher with drop_and_pad):

    dispatch: [E * C, hidden] by expert -> all-to-all (E_local * C rows to each member)
              -> [ep, E_local, C, hidden] -> [E_local, ep * C, hidden] -> experts
    combine:  the reverse
"""

from __future__ import annotations

import torch

from threadpar.comm.group import ProcessGroup


def _exchange(
    x: torch.Tensor, group: ProcessGroup, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    group.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all forward (rows split by in_splits, received by out_splits); the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _exchange(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all_rows(
    x: torch.Tensor, group: ProcessGroup, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    """Autograd all-to-all of rows: in_splits[j] rows of `x` go to member j, out_splits[j] come from it."""
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """counts [ep, E_local]: rows arrived in blocks (source s, expert e), s-major. Returns the row indices
    [R] that list them e-major ((e, s) blocks), so each expert's rows are contiguous."""
    ep, n = counts.shape
    src_starts = (counts.flatten().cumsum(0) - counts.flatten()).view(ep, n)  # where (s, e) starts
    by_expert = counts.t().flatten()  # block sizes in (e, s) order
    dst_starts = by_expert.cumsum(0) - by_expert
    shift = torch.repeat_interleave(src_starts.t().flatten() - dst_starts, by_expert)
    return torch.arange(shift.numel(), device=counts.device) + shift


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class AllToAllDispatcher:
    """Sends expert-sorted rows to the experts' EP ranks, runs `experts` there, and brings the outputs back."""

    def __init__(self, group: ProcessGroup, num_experts: int) -> None:
        self.group = group  # captured at build time (DESIGN.md rule 2): the Functions keep it for backward
        self.ep = group.size()
        self.num_local_experts = num_experts // self.ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        """rows [M, hidden] sorted by expert, counts [E] rows per expert -> experts' outputs [M, hidden]."""
        group, ep, n = self.group, self.ep, self.num_local_experts
        incoming = torch.empty_like(counts)
        group.all_to_all_single(incoming, counts)  # [ep * E_local]: from each source, per local expert
        incoming = incoming.view(ep, n)
        send = counts.view(ep, n).sum(1).tolist()
        receive = incoming.sum(1).tolist()
        received = all_to_all_rows(rows, group, receive, send)  # [R, hidden] by (source, local expert)
        order = expert_major_order(incoming)
        out = experts(received.index_select(0, order), incoming.sum(0).tolist())
        out = out.index_select(0, inverse_permutation(order))  # back to (source, local expert)
        return all_to_all_rows(out, group, send, receive)

    def padded(self, rows: torch.Tensor, capacity: int, experts) -> torch.Tensor:
        """rows [E * C, hidden], expert e's C slots at e * C (every rank of the group with the same C: the
        same token count) -> experts' outputs [E * C, hidden], in the same order."""
        group, ep, n, c = self.group, self.ep, self.num_local_experts, capacity
        hidden = rows.shape[-1]
        splits = [n * c] * ep  # the block for member j: its experts' slots, contiguous
        received = all_to_all_rows(rows, group, splits, splits)  # [ep * n * C] by (source, expert, slot)
        x = received.view(ep, n, c, hidden).transpose(0, 1).reshape(n, ep * c, hidden)
        out = experts(x)  # [n, ep * C, hidden]
        out = out.view(n, ep, c, hidden).transpose(0, 1).reshape(ep * n * c, hidden)
        return all_to_all_rows(out, group, splits, splits)
