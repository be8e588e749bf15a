"""One message per pipeline hop for a structure of tensors: its leaves packed in one byte buffer, behind a
small header that describes them.

A packed message is a uint8 tensor of shape [1, 1, 1, 1, 1, 1, 1, nbytes] (PACKED_PREFIX + [nbytes]); any
backend carries it as it carries one activation, with its shape and dtype (across processes too). Bytes:

    [0, 8)             MAGIC (int64)
    [8, 16)            header length L in bytes (int64)
    [16, 16 + L)       the header, JSON: {"spec": structure spec, "leaves": [[dtype, shape, grad], ...]}
    then the leaves    one after the other, each at an offset aligned to ALIGN (so that a view as any
                       dtype is legal): `byte_layout` of their (dtype, shape) from 16 + L, on both sides

The receiver tells a packed message from a plain activation by its dtype and shape alone (no device read):
a plain tensor that would look like one is sent packed too, so the two can never be confused. The `grad`
flag of a leaf is decided by the sender when it packs (the leaf is floating point and requires grad), so
both sides agree on which leaves carry a gradient back.

Gradients come back as one message too: the gradient of the single gradient-carrying leaf as it is, or,
with several, their bytes at the offsets `byte_layout` gives (the sender knows their dtypes and shapes).
An empty message means "no gradient reached any of them".
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Sequence

import torch

PACKED_PREFIX = (1,) * 7
MAGIC = 0x7470_6D73_6731  # "tpmsg1"
ALIGN = 16  # bytes; a multiple of every dtype's item size (complex128 is 16)
_FIXED = 16  # MAGIC and the header length


@functools.lru_cache(maxsize=32)
def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"packed pipeline message: unknown dtype {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return dtype.itemsize * torch.Size(shape).numel()


def byte_layout(metas: Sequence[tuple[torch.dtype, Sequence[int]]], start: int = 0) -> tuple[list[int], int]:
    """Offsets of tensors of these (dtype, shape) laid out one after the other from `start`, each aligned,
    and the total size."""
    offsets, end = [], start
    for dtype, shape in metas:
        offsets.append(_aligned(end))
        end = offsets[-1] + _nbytes(dtype, shape)
    return offsets, end


def is_packed(message: torch.Tensor) -> bool:
    """Whether a received message is a packed structure (by dtype and shape: no device read)."""
    return message.dtype is torch.uint8 and message.dim() == 8 and tuple(message.shape[:7]) == PACKED_PREFIX


def _write(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.dtype.itemsize
    buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _read(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """`buffer`'s bytes at `offset` as a tensor of its own, sharing the memory (no copy). Not an autograd
    view of the buffer: a chunk may modify a received activation in place, as it may a plain one."""
    start = buffer.storage_offset() + offset  # bytes: buffer is uint8
    if start % dtype.itemsize:  # a message buffer starts aligned; copy rather than fail if one did not
        return buffer[offset : offset + _nbytes(dtype, shape)].clone().view(dtype).view(shape)
    tensor = torch.empty(0, dtype=dtype, device=buffer.device)
    return tensor.set_(buffer.untyped_storage(), start // dtype.itemsize, shape, _contiguous_strides(shape))


def pack(spec: list, leaves: Sequence[torch.Tensor], grad_flags: Sequence[bool], device: torch.device):
    """The packed message for a structure: spec from `structure.flatten`, its tensor leaves, and which
    of them carry a gradient back."""
    described = [[str(t.dtype), list(t.shape), bool(g)] for t, g in zip(leaves, grad_flags)]
    text = json.dumps({"spec": spec, "leaves": described}, separators=(",", ":")).encode()
    prefix = _prefix(text)
    _, metas, total = _parse_header(text)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    buffer[: prefix.numel()].copy_(prefix)
    for leaf, (*_, offset, _) in zip(leaves, metas):
        _write(buffer, offset, leaf.detach())
    return buffer.view(*PACKED_PREFIX, total)


def unpack(message: torch.Tensor) -> tuple[list, list[torch.Tensor], list[bool]]:
    """(spec, leaves, grad flags) of a packed message; the leaves share the message's memory."""
    flat = message.view(-1)
    magic, length = flat[:_FIXED].view(torch.int64).tolist()  # on CUDA: a device read (and the next)
    if magic != MAGIC:
        raise ValueError(f"packed pipeline message: bad magic {magic:#x} (not a threadpar message)")
    spec, metas, _ = _parse_header(flat[_FIXED : _FIXED + length].cpu().numpy().tobytes())
    leaves = [_read(flat, offset, dtype, shape) for dtype, shape, offset, _ in metas]
    return spec, leaves, [grad for *_, grad in metas]


# Headers repeat (the same structure every microbatch): each distinct one is parsed and laid out once.
# The results are only read, so the stages (threads) may share them.
@functools.lru_cache(maxsize=256)
def _parse_header(text: bytes) -> tuple[list, tuple, int]:
    """(spec, ((dtype, shape, offset, grad) per leaf), message size in bytes)."""
    header = json.loads(text)
    described = [(_dtype_named(d), tuple(s), g) for d, s, g in header["leaves"]]
    offsets, total = byte_layout([(d, s) for d, s, _ in described], start=_FIXED + len(text))
    metas = tuple((d, s, o, g) for (d, s, g), o in zip(described, offsets))
    return header["spec"], metas, total


@functools.lru_cache(maxsize=256)
def _prefix(text: bytes) -> torch.Tensor:
    """MAGIC, the length and the header, as the first bytes of a message (a CPU tensor)."""
    return torch.frombuffer(bytearray(struct.pack("<qq", MAGIC, len(text)) + text), dtype=torch.uint8)


def pack_gradients(
    grads: Sequence[torch.Tensor | None],
    metas: Sequence[tuple[torch.dtype, Sequence[int]]],
    device: torch.device,
) -> torch.Tensor:
    """The gradient message for the gradient-carrying leaves of one packed message, in leaf order, given
    their (dtype, shape). A missing gradient (None) is sent as zeros when others did arrive; when none
    arrived the message is empty."""
    if all(g is None for g in grads):
        return torch.empty(0, dtype=torch.uint8, device=device)
    if len(grads) == 1 and grads[0] is not None:  # (not None: not all of them are)
        return grads[0]  # as it is: no copy here (the backend makes the message its own)
    offsets, total = byte_layout(metas)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for grad, offset, (dtype, shape) in zip(grads, offsets, metas):
        if grad is None:
            _read(buffer, offset, dtype, shape).zero_()
        else:
            _write(buffer, offset, grad)
    return buffer


def unpack_gradients(
    message: torch.Tensor, metas: Sequence[tuple[torch.dtype, Sequence[int]]]
) -> list[torch.Tensor | None]:
    """Inverse of `pack_gradients`, given the (dtype, shape) of each gradient-carrying leaf."""
    if message.numel() == 0:
        return [None] * len(metas)
    if len(metas) == 1:
        return [message]
    offsets, _ = byte_layout(metas)
    flat = message.view(-1)
    return [_read(flat, offset, dtype, shape) for (dtype, shape), offset in zip(metas, offsets)]
