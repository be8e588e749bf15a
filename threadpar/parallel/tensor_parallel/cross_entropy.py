"""Cross-entropy over logits split by vocabulary across the TP group, without gathering them.

Rank r holds logits x[:, start:start+n] of the (padded) vocabulary. Per token it computes, over its real
(unpadded) classes, its log-sum-exp, its logit of the target (0 unless the target is in its range) and,
for label smoothing, its sum of logits. One all-gather of these [k, tokens] statistics (k = 2 or 3) lets
every rank combine them identically:

    lse  = logsumexp over ranks of the local log-sum-exps
    loss = lse - (1 - s) * x_target - s * sum_c x_c / V          (V real classes, s = label_smoothing)

which is torch's F.cross_entropy(..., label_smoothing=s): (1-s) * nll + s * mean_c(-log p_c). The
gradient needs no communication: softmax(x) - (1 - s) * onehot(target) - s / V on the real classes,
zero on padded ones. Math in fp32 (or the logits' dtype if wider); the logits are saved, not a softmax.
"""

from __future__ import annotations

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel.collectives import all_gather_along_dim, resolve_tp_group

REDUCTIONS = ("mean", "sum", "none")


def _local_view(ctx, logits: torch.Tensor, target: torch.Tensor):
    """Flattened logits of this rank's real classes [tokens, valid], this rank's target column and mask."""
    valid, start = ctx.valid, ctx.start
    x = logits.reshape(-1, logits.shape[-1])[:, :valid].to(ctx.compute_dtype)
    t = target.reshape(-1).long()
    mine = (t >= start) & (t < start + valid)
    column = (t - start).clamp(0, max(valid - 1, 0))
    return x, column, mine


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocabulary-split logits forward (one all-gather); local softmax gradient backward."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, ignore_index):
        per_rank = logits.shape[-1]
        ctx.group, ctx.start = group, group.rank() * per_rank
        ctx.valid = min(max(vocab_size - ctx.start, 0), per_rank)  # real (unpadded) classes here
        ctx.vocab_size, ctx.smoothing, ctx.ignore_index = vocab_size, label_smoothing, ignore_index
        ctx.compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        x, column, mine = _local_view(ctx, logits, target)
        tokens = x.shape[0]
        if ctx.valid > 0:
            local_lse = torch.logsumexp(x, dim=-1)
            target_logit = x.gather(1, column[:, None]).squeeze(1).masked_fill(~mine, 0.0)
        else:  # every class of this rank is padding
            local_lse = x.new_full((tokens,), float("-inf"))
            target_logit = x.new_zeros(tokens)
        parts = [local_lse, target_logit]
        if label_smoothing > 0:
            parts.append(x.sum(-1))
        stats = torch.stack(parts)  # [k, tokens]
        if group.size() > 1:
            stats = all_gather_along_dim(stats[None], 0, group)  # [tp, k, tokens], identical on every rank
            lse = torch.logsumexp(stats[:, 0], dim=0)
            summed = stats[:, 1:].sum(0)
        else:
            lse, summed = stats[0], stats[1:]
        loss = lse - (1.0 - label_smoothing) * summed[0]
        if label_smoothing > 0:
            loss = loss - label_smoothing / vocab_size * summed[1]
        ignored = target.reshape(-1) == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, target, lse)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        x, column, mine = _local_view(ctx, logits, target)
        tokens, per_rank = x.shape[0], logits.shape[-1]
        if ctx.valid == 0:  # every class of this rank is padding
            grad = torch.zeros(tokens, per_rank, dtype=ctx.compute_dtype, device=logits.device)
        else:
            # softmax - (1 - s) * onehot(target) - s / V on this rank's classes, times the loss gradient
            grad = (x - lse[:, None]).exp_()  # [tokens, valid]
            rows = torch.arange(tokens, device=x.device)
            grad[rows, column] -= (1.0 - ctx.smoothing) * mine.to(grad.dtype)
            if ctx.smoothing > 0:
                grad -= ctx.smoothing / ctx.vocab_size
            scale = grad_loss.reshape(-1).to(ctx.compute_dtype)
            grad *= scale.masked_fill(target.reshape(-1) == ctx.ignore_index, 0.0)[:, None]
            if ctx.valid < per_rank:  # padded classes get zero gradient
                grad = torch.cat([grad, grad.new_zeros(tokens, per_rank - ctx.valid)], dim=1)
        return grad.to(logits.dtype).view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_parallel: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    group: ProcessGroup | str | None = None,
) -> torch.Tensor:
    """F.cross_entropy(logits, target) where each TP rank holds logits_parallel = logits[..., its vocab range].

    logits_parallel: [..., vocab_padded / tp] (a ColumnParallelLinear head, or F.linear with the
    embedding's shard); target: [...] global ids in [0, vocab_size) or ignore_index.
    vocab_size: the real vocabulary; logits of padded classes (ids >= vocab_size) are ignored.
    reduction: "mean" over non-ignored tokens (torch's default), "sum" or "none" (per-token losses).
    Call it on the rank thread (group=None is this rank's TP group).
    """
    group = resolve_tp_group(group)
    if not isinstance(logits_parallel, torch.Tensor) or not logits_parallel.is_floating_point():
        raise TypeError("logits_parallel must be a floating-point tensor of shape [..., vocab / tp]")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError("target must be an int64 (or int32) tensor of class ids")
    if target.shape != logits_parallel.shape[:-1]:
        raise ConfigError(
            f"target has shape {list(target.shape)} but logits_parallel {list(logits_parallel.shape)}; "
            "target must have the logits' shape without the last (vocabulary) dim"
        )
    padded = logits_parallel.shape[-1] * group.size()
    vocab_size = padded if vocab_size is None else vocab_size
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ConfigError(
            f"vocab_size must be an int in [1, {padded}] (the TP size times the local vocabulary), "
            f"got {vocab_size!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ConfigError(f"label_smoothing must be between 0 and 1, got {label_smoothing!r}")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    loss = _VocabParallelCrossEntropy.apply(
        logits_parallel, target, group, vocab_size, float(label_smoothing), ignore_index
    )
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


class VocabParallelCrossEntropyLoss(nn.Module):
    """Module form of vocab_parallel_cross_entropy; the TP group is resolved when built."""

    def __init__(
        self,
        *,
        label_smoothing: float = 0.0,
        vocab_size: int | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        group: ProcessGroup | str | None = None,
    ) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.group = resolve_tp_group(group)
        self.label_smoothing = label_smoothing
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, logits_parallel: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits_parallel,
            target,
            label_smoothing=self.label_smoothing,
            vocab_size=self.vocab_size,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            group=self.group,
        )

    def extra_repr(self) -> str:
        return f"label_smoothing={self.label_smoothing}, vocab_size={self.vocab_size}, reduction={self.reduction!r}"
