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
whose size n is not a power of two: ncclAvg pre-multiplies by a 1/n rounded to half precision (a bias on
every element; see exact_avg_scale), and a plain SUM overflows where the mean is finite (three fp16 ranks
of 40000). There, with 2^m the smallest power of two >= n, every input is pre-multiplied by 2^-m (exact in
the normal range) with a sum NCCL makes for the purpose (ncclRedOpCreatePreMulSum, NCCL >= 2.11; the
sum cannot overflow: it is at most n/2^m of the largest input), then divided by n/2^m (exact as a float)
on the comm stream: round(sum(x * 2^-m) / (n * 2^-m)) is the `threads` backend's round(sum(x) / n) (it
pre-scales the same way: reduce_op.accumulate_). Integers, and fp16/bf16 on NCCL < 2.11: SUM, then a
division on the comm stream that rounds like the `threads` backend (towards zero for integers).
Pure functions only: no CUDA calls here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from threadpar.comm.common.reduce_op import BITWISE, HALF_PRECISION, ReduceOp, avg_pre_scale

# ncclRedOp_t values (nccl.h).
NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
NCCL_REDUCIBLE = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
NCCL_AVG_VERSION = (2, 10)
# ncclRedOpCreatePreMulSum / ncclRedOpDestroy: first in nccl.h of NCCL 2.11 (its release notes: "Add new API
# for creating a reduction operation which multiplies the input by a value before the reduction").
PRE_MUL_SUM_VERSION = (2, 11)
PRE_MUL_SUM = -2  # nccl_op for "the communicator's own pre-multiplied sum" (NcclComm.scaled_sum_op makes it)


class NcclReduction(NamedTuple):
    gather: bool  # all-gather bytes and reduce locally (dtype/op NCCL lacks)
    as_real: bool  # complex viewed as its float (real, imag) pairs
    nccl_op: int  # the ncclRedOp_t to pass
    divide: bool  # AVG as SUM, then divide by the group size on the comm stream
    pre_scale: float = 1.0  # nccl_op PRE_MUL_SUM: each input times this (2^-m), then divide by size * it


class NcclFeatures(NamedTuple):
    """What the loaded NCCL offers to the reductions (by its version)."""

    native_avg: bool  # ncclAvg and bfloat16 (2.10+)
    pre_mul_sum: bool  # ncclRedOpCreatePreMulSum (2.11+)


def has_native_avg(version: Sequence[int | str]) -> bool:
    """NCCL 2.10 brought ncclAvg (and bfloat16, which torch only maps to NCCL from then on)."""
    return tuple(int(v) for v in version[:2]) >= NCCL_AVG_VERSION


def nccl_features(version: Sequence[int | str]) -> NcclFeatures:
    pair = tuple(int(v) for v in version[:2])
    return NcclFeatures(pair >= NCCL_AVG_VERSION, pair >= PRE_MUL_SUM_VERSION)


def exact_avg_scale(dtype: torch.dtype, size: int) -> bool:
    """Whether NCCL's AVG on `dtype` over `size` ranks is unbiased: ncclAvg pre-multiplies every input by
    1/size held in the data type (src/enqueue.cc, hostToDevRedOp), exact when size is a power of two; for
    fp16/bf16 otherwise a rounded 1/size scales every element the same way (1/3 in bfloat16 is +0.2%).
    fp32/fp64 round 1/size to 2^-24 / 2^-53: below their own rounding, so they use NCCL's AVG."""
    power_of_two = size & (size - 1) == 0
    return power_of_two or dtype not in HALF_PRECISION


@functools.lru_cache(maxsize=256)  # pure; asked on every collective (thread-safe: DESIGN.md's table)
def nccl_reduction(dtype: torch.dtype, op: ReduceOp, nccl: NcclFeatures, size: int = 2) -> NcclReduction:
    """`nccl`: what the loaded NCCL has; `size`: the group size (for AVG)."""
    as_real = dtype.is_complex and op in (ReduceOp.SUM, ReduceOp.AVG)
    old_bf16 = dtype == torch.bfloat16 and not nccl.native_avg
    if old_bf16 or op in BITWISE or (not as_real and dtype not in NCCL_REDUCIBLE):
        return NcclReduction(gather=True, as_real=False, nccl_op=-1, divide=False)
    floating = as_real or dtype.is_floating_point
    exact = exact_avg_scale(dtype, size)
    if op is ReduceOp.AVG and nccl.pre_mul_sum and floating and not exact:  # fp16/bf16 (module docstring)
        return NcclReduction(False, as_real, PRE_MUL_SUM, divide=True, pre_scale=avg_pre_scale(size))
    if op is ReduceOp.AVG and not (nccl.native_avg and floating and exact):
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
