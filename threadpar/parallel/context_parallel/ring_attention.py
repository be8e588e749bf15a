"""Ring attention: exact (causal) attention over a sequence split across a context-parallel group.

Each CP rank holds its load-balanced part of q, k and v (sequence_shards.py: chunks r and 2cp - 1 - r, so a
rank's local positions are [a | b] with chunk a early and chunk b late). Over cp steps the k/v blocks go
around the ring: at step i, rank r holds the block of rank s = r - i (mod cp) and attends its queries to
it while already sending that block on to rank r + 1; the per-block outputs are merged exactly with the
log-sum-exp rule. Under the causal mask each step after the first is half a block of work on every rank:

    step 0 (s = r):  q [a|b] on k/v [a|b], causal within the block
    s < r:           q [a|b] on k/v chunk a_s only   (chunk b_s is later than all of rank r's queries)
    s > r:           q chunk b only on k/v [a_s|b_s] (rank r's chunk a is earlier than all of them)

Backward sends the k/v blocks around again, computes each block's dq (kept) and dk/dv given the final
output and LSE, and passes dk/dv partial sums along the ring behind the blocks: the partial sum for rank
s's block starts on rank s + 1 and reaches s after cp - 1 hops, where s adds its own part.

Per rank and attention call, with |kv| = the bytes of the local k and v:
    forward  (cp - 1) * |kv|       backward  (cp - 1) * |kv| + (cp - 1) * |dkv|
Communication goes through the captured ProcessGroup handle: every hop is the group's `permute` (a shift by
one around the ring, a collective: every CP rank makes the same hops in the same order), issued before the
block is computed and waited for after it, so the transfer overlaps the block on backends that copy
asynchronously (nccl: one group of ncclSend/ncclRecv on the CP group's own communicator per hop, no
communicator per pair, no copy, no host meeting). Backward's partial dk/dv sums hop once their block is
done, each in its own shift.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.context_parallel.kernels import BACKWARD, FORWARD, KERNELS, pick_kernel
from threadpar.parallel.groups import resolve_group


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, LSE) into the running ones, in place (views of the rows it covers):
    out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse), lse = log(e^lse + e^block_lse)."""
    diff = block_lse - lse
    out.lerp_(block_out.to(out.dtype), torch.sigmoid(diff).unsqueeze(-1))
    lse.add_(F.softplus(diff))


ALL = slice(None)


class _Ring:
    """One CP member's ring: its neighbours, and which part of each step's block it computes."""

    def __init__(self, group: ProcessGroup, causal: bool, local_len: int) -> None:
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self.shift = [
            (m + 1) % self.size for m in range(self.size)
        ]  # member m sends to m + 1 (permute's src_dst)
        self.causal = causal
        self.half = local_len // 2

    def block(self, step: int) -> tuple[slice, slice, bool]:
        """(query rows, key rows of the block held at `step`, causal mask?) along the sequence dim."""
        src = (self.rank - step) % self.size  # whose k/v block this rank holds at `step`
        if step == 0:
            return ALL, ALL, self.causal
        if not self.causal:
            return ALL, ALL, False
        if src < self.rank:  # every query of this rank comes after the block's early chunk only
            return ALL, slice(None, self.half), False
        return slice(self.half, None), ALL, False  # only this rank's late chunk sees the block


def _seq(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of a [..., seq, dim] tensor (a view)."""
    return t[..., rows, :]


class _RingAttention(torch.autograd.Function):
    """Ring attention forward; k/v around the ring again and dk/dv partial sums behind them backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel):
        ring = _Ring(group, causal, q.shape[-2])
        attend = FORWARD[kernel]
        kv = torch.stack([k, v])  # [2, B, H, S, D]: one message per hop
        out: torch.Tensor | None = None  # set at step 0
        lse: torch.Tensor | None = None
        for step in range(ring.size):
            hop = _hop(group, ring, kv) if step + 1 < ring.size else None
            rows, cols, masked = ring.block(step)
            block_out, block_lse = attend(_seq(q, rows), _seq(kv[0], cols), _seq(kv[1], cols), masked, scale)
            if step == 0:
                out, lse = block_out.to(torch.promote_types(q.dtype, torch.float32)), block_lse
            else:
                assert out is not None and lse is not None
                _merge_(_seq(out, rows), lse[..., rows], block_out, block_lse)
            if hop is not None:
                kv = hop.wait()
        assert out is not None  # the ring has at least one step
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, grads = ctx.ring, ctx.scale, BACKWARD[ctx.kernel]
        group = ring.group
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        own: torch.Tensor | None = None  # this rank's own part of its dk/dv, [2, B, H, S, D]
        incoming: torch.Tensor | None = None  # the previous rank's partial dk/dv of this step's block
        for step in range(ring.size):
            hop = _hop(group, ring, kv) if step + 1 < ring.size else None
            rows, cols, masked = ring.block(step)
            dq_i, dk_i, dv_i = grads(
                _seq(dout, rows), _seq(q, rows), _seq(kv[0], cols), _seq(kv[1], cols),
                _seq(out, rows), lse[..., rows], masked, scale,
            )  # fmt: skip
            _seq(dq, rows).add_(dq_i)
            if step == 0:
                own = torch.stack([dk_i, dv_i]).to(acc)
            else:
                # The partial dk/dv of this step's block from the ranks before this one (none at step 1),
                # plus this rank's part, on to the next rank: it reaches the block's owner after its last hop.
                if incoming is None:
                    incoming = torch.zeros(kv.shape, dtype=acc, device=kv.device)
                _seq(incoming[0], cols).add_(dk_i)
                _seq(incoming[1], cols).add_(dv_i)
                incoming = _hop(group, ring, incoming).wait()
            if hop is not None:
                kv = hop.wait()
        assert own is not None  # set at step 0
        if incoming is not None:
            own.add_(incoming)  # the other ranks' parts of this rank's dk/dv
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


class _Hop:
    """A tensor on its way from the previous rank of the ring: `wait()` gives it (the caller's stream ordered
    after its arrival)."""

    __slots__ = ("_received", "_work")

    def __init__(self, received: torch.Tensor, work: object) -> None:
        self._received, self._work = received, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()  # type: ignore[attr-defined]
        return self._received


def _hop(group: ProcessGroup, ring: _Ring, tensor: torch.Tensor) -> _Hop:
    """Send `tensor` to the next rank of the ring and receive the previous rank's (one shift, issued now)."""
    received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _Hop(received, group.permute([tensor], [received], ring.shift, async_op=True))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ConfigError(
                f"ring_attention: {name} must be a [batch, heads, seq, head_dim] tensor, got {got}"
            )
    if not q.shape == k.shape == v.shape:
        raise ConfigError(
            f"ring_attention: q, k and v must have one shape [batch, heads, seq, head_dim] (multi-head "
            f"attention; repeat k/v heads for grouped-query attention), got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}"
        )
    if causal and cp > 1 and q.shape[-2] % 2:
        raise ConfigError(
            f"ring_attention: the local sequence has {q.shape[-2]} positions, but causal ring attention needs "
            "the two load-balanced chunks of split_sequence (an even number); pad the whole sequence by "
            "get_padding(seq_len, cp_size) positions first"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup | str | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of this rank's queries on the whole sequence's keys, split over a CP group.

    q, k, v: [batch, heads, seq / cp, head_dim], this rank's part of the sequence as `split_sequence`
    lays it out (with causal=False any split works). Returns this rank's part of
    softmax(q k^T * scale [+ causal mask]) v, like F.scaled_dot_product_attention on the whole sequence.
    group: None for this rank's CP group (resolved now: call on the rank thread). kernel: "auto", "flash"
    (CPU) or "math" (see kernels.py). The identity on a group of one: plain scaled_dot_product_attention.
    """
    group = resolve_group(group, "CP")
    _check(q, k, v, group.size(), causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if group.size() == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _RingAttention.apply(q, k, v, group, bool(causal), scale, pick_kernel(kernel, q.device))


class RingAttention(nn.Module):
    """`ring_attention` with the CP group captured when the module is built (on the rank thread)."""

    def __init__(
        self,
        group: ProcessGroup | str | None = None,
        *,
        causal: bool = True,
        scale: float | None = None,
        kernel: str = "auto",
    ) -> None:
        super().__init__()
        self.group = resolve_group(group, "CP")
        self.causal, self.scale, self.kernel = bool(causal), scale, kernel
        if kernel not in KERNELS:
            raise ConfigError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, causal=self.causal, scale=self.scale, kernel=self.kernel)

    def extra_repr(self) -> str:
        return (
            f"cp={self.group.size()}, rank={self.group.rank()}, causal={self.causal}, kernel={self.kernel!r}"
        )
