"""comm/nccl/reduction.py: how each dtype and ReduceOp maps onto NCCL, and the buffer views (pure, no CUDA)."""

import pytest
import torch

from threadpar import ReduceOp
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.nccl.reduction import contiguous_span, has_native_avg, nccl_reduction, wire


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
    assert tuple(nccl_reduction(dtype, op, native_avg)) == expected


@pytest.mark.parametrize(
    ("dtype", "size", "native"),
    [
        (torch.bfloat16, 4, True),
        (torch.bfloat16, 3, False),
        (torch.float16, 6, False),
        (torch.float32, 3, True),
    ],
)
def test_avg_of_half_types_sums_then_divides_where_one_over_n_is_inexact(dtype, size, native):
    how = nccl_reduction(dtype, ReduceOp.AVG, True, size)
    assert (how.nccl_op, how.divide) == ((4, False) if native else (0, True))


def test_native_avg_from_nccl_2_10():
    assert has_native_avg((2, 10, 3)) and has_native_avg((2, 21, 5, "+cuda12.4"))
    assert not has_native_avg((2, 9, 9))


def test_views():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert torch.equal(wire(z, nccl_reduction(z.dtype, ReduceOp.SUM, True)), torch.tensor([1.0, 2, 3, -4]))
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
