"""Copies between rank threads' tensors at memory speed.

For large contiguous CPU tensors of one dtype, glibc's memmove (non-temporal stores; ctypes releases the
GIL) measured 1.7x faster than `Tensor.copy_` here (64 MiB: 8 ms vs 14 ms). Everything else uses copy_.
"""

from __future__ import annotations

import ctypes

import torch

# Below this, copy_'s lower call overhead wins.
MEMMOVE_MIN_BYTES = 64 * 1024


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (same number of elements)."""
    nbytes = dst.nbytes
    if (
        nbytes >= MEMMOVE_MIN_BYTES
        and dst.dtype == src.dtype
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.numel() == src.numel()
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src)
