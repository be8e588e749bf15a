"""The arithmetic of the NCCL double (fake_nccl.py): what each collective computes, and the buffer rules NCCL
does not check but breaks on (sizes for the communicator, in-place layouts), each with its NCCL source."""

from __future__ import annotations

from typing import Any

import torch

from threadpar.comm.nccl.library import RESULT_NAMES
from threadpar.errors import NcclError

INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 4, 5, 6


def nccl_error(function: str, code: int, message: str) -> NcclError:
    """The error the binding raises for a failed call (threadpar.comm.nccl.library.NcclLibrary._error)."""
    return NcclError(f"{function} failed: {RESULT_NAMES[code]} ({message})")


def _reduce(inputs: list[torch.Tensor], op: int | str, scalars: list[Any]) -> torch.Tensor:
    """`op`: a built-in ncclRedOp_t (ncclSum=0, ncclProd=1, ncclMax=2, ncclMin=3, ncclAvg=4: nccl.h; there is
    no bitwise op), or a user-created pre-multiplied sum (fake_nccl_user_ops.PRE_MUL_SUM) with each rank's
    own scalar in `scalars` (its op's, held in the data type)."""
    if op == "PreMulSum":
        return _scaled_sum(inputs, scalars)
    if op == 4 and inputs[0].dtype.is_floating_point:
        return _pre_mul_sum(inputs)
    result = inputs[0].clone()
    for t in inputs[1:]:
        if op in (0, 4):
            result.add_(t)
        elif op == 1:
            result.mul_(t)
        else:
            (torch.maximum if op == 2 else torch.minimum)(result, t, out=result)
    if op == 4:
        # ncclAvg on integers: hostToDevRedOp (src/enqueue.cc) picks ncclDevSumPostDiv, FuncSumPostDiv
        # (src/device/reduce_kernel.h) divides the sum by nRanks with C's integer division (towards zero).
        return result.div_(len(inputs), rounding_mode="trunc")
    return result


def _pre_mul_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """ncclAvg on floating types, as NCCL computes it: hostToDevRedOp (src/enqueue.cc) turns it into
    ncclDevPreMulSum with the scalar 1/nRanks held IN THE DATA TYPE (f16 = __float2half(float(1.0/n)),
    bf16 = __float2bfloat16(float(1.0/n)), f32 = float(1.0/n), f64 = 1.0/n), and FuncPreMulSum
    (src/device/reduce_kernel.h) multiplies every input by it (rounded to the type) before the sum, which
    adds in the type. So for n not a power of two the fp16/bf16 average carries the rounding of 1/n: a
    bias of the same sign on every element (1/3 in bf16 is 0.333984375, +0.2%). (The sum runs in rank order
    here; NCCL's ring adds in ring order per chunk: a rounding-level difference the double does not model.)"""
    dtype, n = inputs[0].dtype, len(inputs)
    exact = 1.0 / n
    single = float(torch.tensor(exact, dtype=torch.float32))  # float(1.0/n)
    scale = torch.tensor(exact if dtype == torch.float64 else single, dtype=torch.float64)
    scale = scale.to(dtype)  # float -> half/bfloat16 rounds to nearest, as __float2half/__float2bfloat16
    return _scaled_sum(inputs, [scale] * n)


def _scaled_sum(inputs: list[torch.Tensor], scalars: list[torch.Tensor]) -> torch.Tensor:
    """FuncPreMulSum (src/device/reduce_kernel.h): each rank's input times its scalar, rounded to the data
    type, then summed in the data type (in rank order here)."""
    result = inputs[0] * scalars[0]
    for t, scale in zip(inputs[1:], scalars[1:], strict=True):
        result.add_(t * scale)
    return result


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _in_place_offset(op: Any, parts: list[Any], count: int) -> str | None:
    """NCCL's in-place rule for the two collectives whose buffers differ in size (docs, usage/inplace.html,
    "In-place Operations"): ncclAllGather(data + rank * sendcount, data, ...) and ncclReduceScatter(data,
    data + rank * recvcount, ...) are in place; any other overlap of the send and receive buffers is not
    an operation NCCL defines (it reads bytes it has already overwritten, or the reverse)."""
    for rank, p in enumerate(parts):
        if p.output is None or not _overlap(p.input, p.output):
            continue
        whole, piece = (p.output, p.input) if op.kind == "all_gather" else (p.input, p.output)
        want = whole.data_ptr() + rank * count * whole.element_size()
        if piece.data_ptr() != want:
            offset = (piece.data_ptr() - whole.data_ptr()) // whole.element_size()
            return (
                f"NCCL {op.kind}: rank {rank}'s send and receive buffers overlap, but its "
                f"{'input' if op.kind == 'all_gather' else 'output'} starts at element {offset} of the "
                f"{'output' if op.kind == 'all_gather' else 'input'}, not at rank * count = {rank * count} (NCCL's "
                "in-place rule, usage/inplace.html): NCCL would read data it already overwrote"
            )
    return None


def compute(op: Any) -> str | None:
    """Check a collective whose parts have all reached their streams' heads and compute it; returns what
    NCCL would get wrong, if anything (`op`: a fake_nccl.CollectiveOp)."""
    parts = [op.parts[r] for r in range(op.size)]  # by NCCL rank
    count, _dtype, reduce_op, root = op.args
    if op.kind in ("all_gather", "reduce_scatter"):
        error = _in_place_offset(op, parts, count)
        if error is not None:
            return error
    return _sizes(op, parts, count, root) or _execute(op, parts, count, reduce_op, root)


def _sizes(op: Any, parts: list[Any], count: int, root: Any) -> str | None:
    if op.kind == "reduce" and parts[root].output is None:
        return (
            f"NCCL reduce: rank {root} is the root, but passed no recvbuff: NCCL would write through a null "
            "pointer (nccl.h: the root's recvbuff receives the result)"
        )
    if op.kind == "all_gather":
        short = [r for r, p in enumerate(parts) if p.output.numel() < op.size * count]
        if short:
            return (
                f"NCCL all_gather over {op.size} ranks writes {op.size * count} elements, but ranks {short} "
                "passed smaller outputs (nccl.h: recvbuff holds nranks x sendcount): buffer overrun"
            )
    if op.kind == "reduce_scatter":
        short = [r for r, p in enumerate(parts) if p.input.numel() < op.size * count]
        if short:
            return (
                f"NCCL reduce_scatter over {op.size} ranks reads {op.size * count} elements, but ranks {short} "
                "passed smaller inputs (nccl.h: sendbuff holds nranks x recvcount): buffer overrun"
            )
    return None


def _execute(op: Any, parts: list[Any], count: int, reduce_op: Any, root: Any) -> str | None:
    inputs = [p.input for p in parts]
    scalars = [op.scalars.get(r) for r in range(op.size)]  # (a user-created op's, by rank)
    if op.kind == "all_reduce":
        result = _reduce(inputs, reduce_op, scalars)
        for p in parts:
            p.output.copy_(result)
    elif op.kind == "reduce":
        parts[root].output.copy_(_reduce(inputs, reduce_op, scalars))
    elif op.kind == "broadcast":
        source = inputs[root].clone()
        for p in parts:
            p.output.copy_(source)
    elif op.kind == "all_gather":
        gathered = torch.cat([t.view(-1) for t in inputs])
        for p in parts:
            p.output.copy_(gathered)
    elif op.kind == "reduce_scatter":
        blocks = [t.view(-1)[: op.size * count] for t in inputs]
        result = _reduce(blocks, reduce_op, scalars).view(op.size, -1)
        for r, p in enumerate(parts):
            p.output.copy_(result[r])
    return None
