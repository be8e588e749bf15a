"""Byte views of tensors and the index arithmetic that splits a collective's elements between workers."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of any dtype as a 1-D uint8 view of its memory (no copy: writes reach `tensor`)."""
    return tensor.view(-1).view(torch.uint8)


def split_range(total: int, parts: int) -> list[tuple[int, int]]:
    """Split range(total) into `parts` contiguous, balanced ranges."""
    bounds = [total * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def pieces(numels: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Map the range [start, stop) of the concatenation of tensors with `numels` elements onto
    (tensor index, start, stop) pieces of the individual tensors."""
    out, offset = [], 0
    for i, n in enumerate(numels):
        a, b = max(start, offset), min(stop, offset + n)
        if a < b:
            out.append((i, a - offset, b - offset))
        offset += n
        if offset >= stop:
            break
    return out
