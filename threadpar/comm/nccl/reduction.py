"""How the nccl backend maps each (dtype, ReduceOp) and tensor view onto what NCCL offers.

NCCL reduces float32/64, float16, bfloat16, int8, uint8, int32 and int64. The `threads` backend also
supports bool, int16 and complex; the nccl backend covers them the same way:

- data movement (broadcast, all-gather, copies) does not care about dtypes: tensors travel as bytes;
- complex SUM/AVG reduce the (real, imag) float pairs, which is the same arithmetic;
- whatever is left (bool, int16, complex PRODUCT, and the bitwise ops BAND/BOR/BXOR on any dtype) is
  all-gathered as bytes and reduced by each member on its comm stream, in rank order, with the very
  function the `threads` backend uses (`accumulate_`).

NCCL has no bitwise reductions (ncclRedOp_t in nccl.h: ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg), and
torch's ProcessGroupNCCL refuses them ("Cannot use ReduceOp.BAND with NCCL": getNcclReduceOp in
torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp). threadpar reduces them with the byte all-gather above
instead, so code written for the `threads` backend runs unchanged on GPUs.

AVG uses NCCL's own average (ncclAvg, NCCL >= 2.10) for floating dtypes, except fp16/bf16 over a group
whose size is not a power of two (NCCL pre-multiplies by a 1/n rounded to half precision: a bias on every
element; see exact_avg_scale); otherwise SUM, then a division on the comm stream that rounds like the
`threads` backend (towards zero for integers), so those results equal the threads backend's.
Pure functions only: no CUDA calls here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from threadpar.comm.common.reduce_op import BITWISE, ReduceOp

# ncclRedOp_t values (nccl.h).
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
NCCL_REDUCIBLE = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
NCCL_AVG_VERSION = (2, 10)


class NcclReduction(NamedTuple):
    gather: bool  # all-gather bytes and reduce locally (dtype/op NCCL lacks)
    as_real: bool  # complex viewed as its float (real, imag) pairs
    nccl_op: int  # the ncclRedOp_t to pass
    divide: bool  # AVG as SUM, then divide by the group size on the comm stream


def has_native_avg(version: Sequence[int | str]) -> bool:
    """NCCL 2.10 brought ncclAvg (and bfloat16, which torch only maps to NCCL from then on)."""
    return tuple(int(v) for v in version[:2]) >= NCCL_AVG_VERSION


def exact_avg_scale(dtype: torch.dtype, size: int) -> bool:
    """Whether NCCL's AVG on `dtype` over `size` ranks is unbiased: ncclAvg pre-multiplies every input by
    1/size held in the data type (src/enqueue.cc, hostToDevRedOp), exact when size is a power of two; for
    fp16/bf16 otherwise a rounded 1/size scales every element the same way (1/3 in bfloat16 is +0.2%).
    fp32/fp64 round 1/size to 2^-24 / 2^-53: below their own rounding, so they use NCCL's AVG."""
    power_of_two = size & (size - 1) == 0
    return power_of_two or dtype not in (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=256)  # pure; asked on every collective (thread-safe: DESIGN.md's table)
def nccl_reduction(dtype: torch.dtype, op: ReduceOp, native_avg: bool, size: int = 2) -> NcclReduction:
    """`native_avg`: NCCL >= 2.10 (has ncclAvg and bfloat16); `size`: the group size (for AVG)."""
    as_real = dtype.is_complex and op in (ReduceOp.SUM, ReduceOp.AVG)
    old_bf16 = dtype == torch.bfloat16 and not native_avg
    if old_bf16 or op in BITWISE or (not as_real and dtype not in NCCL_REDUCIBLE):
        return NcclReduction(gather=True, as_real=False, nccl_op=-1, divide=False)
    floating = as_real or dtype.is_floating_point
    if op is ReduceOp.AVG and not (native_avg and floating and exact_avg_scale(dtype, size)):
        return NcclReduction(gather=False, as_real=as_real, nccl_op=NCCL_OPS[ReduceOp.SUM], divide=True)
    return NcclReduction(gather=False, as_real=as_real, nccl_op=NCCL_OPS[op], divide=False)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a 1-D view (itself when it is 1-D: a view costs a tensor allocation)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def wire(tensor: torch.Tensor, how: NcclReduction) -> torch.Tensor:
    """The 1-D view of a contiguous tensor that NCCL reduces as `how` says."""
    flat_view = flat(tensor)
    return torch.view_as_real(flat_view).view(-1) if how.as_real else flat_view


def contiguous_span(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """If `parts` lie back to back in one storage (the chunks of one contiguous tensor, as
    all_gather_into_tensor and reduce_scatter_tensor pass them), the 1-D tensor covering all of them."""
    first = parts[0]
    step = first.numel()
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.numel() == step for p in parts):
        return None
    storage = first.untyped_storage().data_ptr()
    size = step * first.element_size()
    for i, p in enumerate(parts):
        if p.untyped_storage().data_ptr() != storage or p.data_ptr() != first.data_ptr() + i * size:
            return None
    return first.as_strided((step * len(parts),), (1,), first.storage_offset())
