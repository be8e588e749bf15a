"""Peak memory per rank.

On CUDA, the caching allocator knows each device's peak. On CPU all ranks share one allocator, so
threadpar measures what differs between ranks and strategies: the bytes of activations saved for backward
that are alive at once (saved-tensor hooks are per thread, so each rank thread sees only its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _Saved:
    """Holds one saved tensor; its death (when autograd frees the graph) returns its bytes."""

    __slots__ = ("nbytes", "tensor", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: SavedActivationTracker) -> None:
        self.tensor = tensor
        self.tracker = tracker
        self.nbytes = tensor.numel() * tensor.element_size()
        tracker.live += self.nbytes
        tracker.peak = max(tracker.peak, tracker.live)

    def __del__(self) -> None:
        self.tracker.live -= self.nbytes


class SavedActivationTracker:
    """Counts the bytes of tensors autograd saves for backward while `track()` is active on this thread.

    Parameters saved by autograd (e.g. a weight for the input's gradient) are counted too: they are what
    the backward holds on to. Views of one storage are counted once per save, an upper bound.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[SavedActivationTracker]:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, self), lambda s: s.tensor):
            yield self

    def reset_peak(self) -> None:
        self.peak = self.live


def device_peak_bytes(device: torch.device) -> int | None:
    """The allocator's peak on a CUDA device since the last reset (None on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None
