"""comm/nccl/reduction.py: how each dtype and ReduceOp maps onto NCCL, and the buffer views (pure, no CUDA)."""

import pytest
import torch

from threadpar import ReduceOp
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.nccl.reduction import (
    PRE_MUL_SUM,
    NcclFeatures,
    contiguous_span,
    has_native_avg,
    nccl_features,
    nccl_reduction,
    wire,
)

NEW, NO_PRE_MUL_SUM, OLD = NcclFeatures(True, True), NcclFeatures(True, False), NcclFeatures(False, False)


@pytest.mark.parametrize(
    ("dtype", "op", "native_avg", "expected"),
    [
        (torch.float32, ReduceOp.SUM, True, (False, False, 0, False)),
        (torch.bfloat16, ReduceOp.AVG, True, (False, False, 4, False)),
        (torch.float16, ReduceOp.AVG, False, (False, False, 0, True)),
        (torch.int64, ReduceOp.AVG, True, (False, False, 0, True)),  # integer AVG truncates like threads
        (torch.uint8, ReduceOp.MIN, True, (False, False, 3, False)),
        (torch.int32, ReduceOp.PRODUCT, True, (False, False, 1, False)),
        (torch.complex64, ReduceOp.SUM, True, (False, True, 0, False)),
        (torch.complex128, ReduceOp.AVG, True, (False, True, 4, False)),
        (torch.complex64, ReduceOp.PRODUCT, True, (True, False, -1, False)),
        (torch.int16, ReduceOp.MAX, True, (True, False, -1, False)),
        (torch.bool, ReduceOp.SUM, True, (True, False, -1, False)),
        (torch.bfloat16, ReduceOp.SUM, False, (True, False, -1, False)),  # NCCL < 2.10 has no bfloat16
    ],
)
def test_nccl_reduction(dtype, op, native_avg, expected):
    how = nccl_reduction(dtype, op, NEW if native_avg else OLD)
    assert tuple(how)[:4] == expected and how.pre_scale == 1.0


@pytest.mark.parametrize(
    ("dtype", "size", "expected"),
    [
        (torch.bfloat16, 4, (4, False, 1.0)),  # 1/4 is exact: ncclAvg
        (torch.bfloat16, 3, (PRE_MUL_SUM, True, 0.25)),  # x * 2^-2 summed, then / 0.75
        (torch.float16, 6, (PRE_MUL_SUM, True, 0.125)),
        (torch.float16, 9, (PRE_MUL_SUM, True, 0.0625)),
        (torch.float32, 3, (4, False, 1.0)),  # float(1/3) rounds below fp32's own rounding
    ],
)
def test_avg_of_half_types_pre_scales_by_a_power_of_two_where_one_over_n_is_inexact(dtype, size, expected):
    how = nccl_reduction(dtype, ReduceOp.AVG, NEW, size)
    assert (how.nccl_op, how.divide, how.pre_scale) == expected
    # NCCL < 2.11 has no ncclRedOpCreatePreMulSum: SUM, then divide (which can overflow)
    old = nccl_reduction(dtype, ReduceOp.AVG, NO_PRE_MUL_SUM, size)
    assert (old.nccl_op, old.divide) == ((4, False) if expected[0] == 4 else (0, True))


def test_native_avg_from_nccl_2_10_and_pre_mul_sum_from_2_11():
    assert has_native_avg((2, 10, 3)) and has_native_avg((2, 21, 5, "+cuda12.4"))
    assert not has_native_avg((2, 9, 9))
    assert nccl_features((2, 10, 3)) == NO_PRE_MUL_SUM and nccl_features((2, 11, 4)) == NEW
    assert nccl_features((2, 9, 9)) == OLD


def test_views():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert torch.equal(wire(z, nccl_reduction(z.dtype, ReduceOp.SUM, NEW)), torch.tensor([1.0, 2, 3, -4]))
    assert byte_view(torch.zeros((), dtype=torch.int16)).shape == (2,)
    assert byte_view(z).dtype == torch.uint8 and byte_view(z).numel() == 16


def test_joined_finds_the_chunks_of_one_buffer_and_nothing_else():
    whole = torch.arange(12.0)
    chunks = list(whole.view(3, 4).unbind(0))
    view = contiguous_span(chunks)
    assert view is not None and view.data_ptr() == whole.data_ptr() and view.shape == (12,)
    view[5] = -1
    assert whole[5] == -1
    assert contiguous_span(chunks[::-1]) is None  # out of order
    assert contiguous_span([torch.zeros(4) for _ in range(3)]) is None  # separate tensors
    assert contiguous_span(list(whole.view(4, 3).t().unbind(0))) is None  # strided chunks
