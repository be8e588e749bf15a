"""The storage side of one gradient bucket: which parameters, and a flat buffer when one is needed.

With gradient_as_bucket_view the buffer exists from the start and each parameter's gradient is a view into
it. Otherwise the gradients stay where autograd put them and the default hook averages them in place; the
buffer is allocated (once, then reused) only when a comm hook asks for `GradBucket.buffer()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from threadpar.comm.common.work import Work


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if `a` and `b` are the same elements (same start, shape and strides)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class Bucket:
    __slots__ = ("buffer", "members", "numels", "params", "reduction", "views")

    def __init__(self, members: list[int], params: Sequence[torch.nn.Parameter], with_views: bool) -> None:
        self.members = members  # indices into the reducer's parameters, in bucket order
        self.params = [params[i] for i in members]
        self.numels = [p.numel() for p in self.params]
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] | None = None  # with gradient_as_bucket_view: param.grad for each
        self.reduction: Work | torch.futures.Future | None = None  # in flight during a backward
        if with_views:
            buffer = self._allocate()
            self.views = [piece.view(p.shape) for piece, p in zip(buffer.split(self.numels), self.params)]

    def _allocate(self) -> torch.Tensor:
        first = self.params[0]
        self.buffer = torch.zeros(sum(self.numels), dtype=first.dtype, device=first.device)
        return self.buffer

    def view(self, slot: int) -> torch.Tensor:
        """The bucket's view for its `slot`-th parameter (it has views with gradient_as_bucket_view)."""
        assert self.views is not None, "built without gradient_as_bucket_view: the bucket has no views"
        return self.views[slot]

    def flatten(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The buffer holding `grads` (copied in unless they are its views)."""
        if self.views is not None:
            assert self.buffer is not None  # the views are views of it
            return self.buffer
        buffer = self.buffer if self.buffer is not None else self._allocate()
        torch.cat([g.reshape(-1) for g in grads], out=buffer)
        return buffer

    def scatter(self, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        """Write the flat averages into the gradients (no-op for the bucket's own buffer with views)."""
        if self.views is not None:
            assert self.buffer is not None  # the views are views of it
            if not shares_memory(flat, self.buffer):
                self.buffer.copy_(flat)
            return
        for grad, piece in zip(grads, flat.split(self.numels)):
            grad.copy_(piece.view_as(grad))
