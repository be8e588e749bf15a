"""How the distributed optimizer splits parameters: flat buckets, each divided evenly over its DP group.

A bucket is a list of parameters of one dtype and device laid end to end in one flat buffer (the
parameters become views into it, as in Megatron's param buffer), padded to a multiple of the group size P.
Rank r of the group owns the contiguous range [r*S, (r+1)*S) of every bucket, S = padded size / P, so the
updated parameters come back with one in-place all-gather per bucket, and under ZeRO-2 a reduce-scatter of
the bucket's gradients leaves exactly the rank's range on each rank.

    bucket  [ p0 ........ | p1 .... | p2 ..... |pad]     P = 2
    rank 0  [ p0 ........ | p1 ]                          pieces: p0[0:12], p1[0:2]
    rank 1                   [ .. | p2 ..... |pad]        pieces: p1[2:6], p2[0:8]

A parameter cut by a range boundary has one piece per rank that holds part of it; the optimizer on each
rank steps its pieces (element-wise state makes that exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from threadpar.comm.group import ProcessGroup


@dataclass(frozen=True)
class Piece:
    """The part [lo, hi) of parameter `index` (position in its bucket, flattened) that this rank owns."""

    index: int
    lo: int
    hi: int
    shard_offset: int  # where the piece starts in the rank's range of the bucket


@dataclass(eq=False)
class ShardBucket:
    """Parameters sharing one flat buffer, split over `group`; `reducer_bucket` is the DDP bucket whose
    reduction it takes over under ZeRO-2 (None: not one of DDP's buckets)."""

    group: ProcessGroup
    params: list[torch.nn.Parameter]
    reducer_bucket: int | None = None
    offsets: list[int] = field(init=False)
    numel: int = field(init=False)  # unpadded
    shard_size: int = field(init=False)  # S: elements per rank
    pieces: list[Piece] = field(init=False)
    flat: torch.Tensor = field(init=False)  # the parameters' storage, [P * S]

    def __post_init__(self) -> None:
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        size = self.group.size()
        self.shard_size = -(-self.numel // size)
        start, end = self.rank_range
        self.pieces = []
        for i, (offset, n) in enumerate(zip(self.offsets, sizes)):
            lo, hi = max(offset, start), min(offset + n, end)
            if lo < hi:
                self.pieces.append(Piece(i, lo - offset, hi - offset, lo - start))

    @property
    def rank_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the padded flat buffer."""
        r = self.group.rank()
        return r * self.shard_size, (r + 1) * self.shard_size

    def take_storage(self) -> None:
        """Move the parameters into one flat buffer (zero padding); each parameter becomes a view into it."""
        first = self.params[0]
        self.flat = torch.zeros(self.shard_size * self.group.size(), dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets):
                view = self.flat[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)

    def shard(self) -> torch.Tensor:
        """This rank's range of the flat parameter buffer (a view)."""
        start, end = self.rank_range
        return self.flat[start:end]

    def split_full(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A [P * S] tensor laid out like `flat`, cut into views shaped like each parameter."""
        return [
            flat[offset : offset + p.numel()].view(p.shape) for p, offset in zip(self.params, self.offsets)
        ]
