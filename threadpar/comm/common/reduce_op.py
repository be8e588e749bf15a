"""Reduction operators and the one function that applies them, in rank order, to a list of tensors."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from threadpar.comm.common.gpu import is_gpu
from threadpar.errors import ConfigError


class ReduceOp(enum.Enum):
    SUM = "SUM"
    AVG = "AVG"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    BAND = "BAND"
    BOR = "BOR"
    BXOR = "BXOR"

    extra: tuple[tuple[str, str], ...]  # set on every member below (not a member itself: no value here)

    @classmethod
    def parse(cls, op: object) -> ReduceOp:
        """Accept a ReduceOp, its name, or torch.distributed.ReduceOp values (matched by name)."""
        if isinstance(op, ReduceOp):
            return op
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if name is None and hasattr(op, "__str__"):
            name = str(op).rsplit(".", 1)[-1]  # e.g. "RedOpType.SUM"
        try:
            return cls(str(name).upper())
        except ValueError:
            names = ", ".join(o.value for o in cls)
            raise ConfigError(f"unsupported reduce op {op!r}; use one of {names}") from None


for _op in ReduceOp:
    _op.extra = (("op", _op.value),)  # how a call shows its op in a collective's description


BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
# AVG of these sums pre-scaled inputs (accumulate_): their sum of a few large values overflows where the mean
# does not (fp16's largest is 65504: three ranks of 40000).
HALF_PRECISION = frozenset({torch.float16, torch.bfloat16})
_BITWISE_INPLACE = {ReduceOp.BAND: "bitwise_and_", ReduceOp.BOR: "bitwise_or_", ReduceOp.BXOR: "bitwise_xor_"}


def check_reducible(dtype: torch.dtype, op: ReduceOp) -> None:
    if op is ReduceOp.SUM:
        return
    if dtype.is_complex and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise ConfigError(f"ReduceOp.{op.value} is not defined for complex tensors ({dtype}); use SUM or AVG")
    if op in BITWISE and (dtype.is_floating_point or dtype.is_complex):
        # As torch's gloo backend (ProcessGroupGloo.cpp: band/bor/bxor raise for non-integral dtypes).
        raise ConfigError(
            f"ReduceOp.{op.value} is a bitwise op: it needs an integer or bool tensor, got {dtype}; "
            "reduce a .view() of the bits as an integer dtype, or use another op"
        )


def accumulate_(acc: torch.Tensor, others: Sequence[torch.Tensor], op: ReduceOp, count: int) -> torch.Tensor:
    """Reduce `others` into `acc` in place (no allocation); `count` is the number of members, for AVG.

    In-place ops are the fast ones on CPU (add_ beats add(out=) by 1.5x here) and allocate nothing.
    Ranks sharing GPUs on the threads backend may hold their tensors on different devices: those are
    copied to `acc`'s device first (on the calling thread's current streams).
    """
    if others and is_gpu(acc.device):
        others = [p if p.device == acc.device else p.to(acc.device, non_blocking=True) for p in others]
    if op is ReduceOp.AVG and count == 2 and len(others) == 1 and acc.dtype.is_floating_point:
        # (a + b) / 2 in one pass over memory instead of two (add_, div_); it cannot overflow either (lerp
        # computes a + 0.5 * (b - a) in float for fp16/bf16: torch's opmath, ATen's lerp kernels).
        return acc.lerp_(others[0], 0.5)
    if op is ReduceOp.AVG and acc.dtype in HALF_PRECISION:
        # Pre-scale by 2^-m (2^m >= count): exact in the normal range, so each rounded partial sum is the
        # unscaled one's times 2^-m, and the sum cannot overflow (the nccl backend makes the same sum with
        # ncclRedOpCreatePreMulSum: nccl/reduction.py). add_'s alpha is applied in float, one rounding.
        scale = avg_pre_scale(count)
        acc.mul_(scale)
        for p in others:
            acc.add_(p, alpha=scale)
        return divide_mean_(acc, count, scale)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        for p in others:
            acc.add_(p)
        if op is ReduceOp.AVG:
            divide_mean_(acc, count)
    elif op is ReduceOp.PRODUCT:
        for p in others:
            acc.mul_(p)
    elif op in BITWISE:
        inplace = getattr(acc, _BITWISE_INPLACE[op])
        for p in others:
            inplace(p)
    else:
        binary = torch.minimum if op is ReduceOp.MIN else torch.maximum
        for p in others:
            binary(acc, p, out=acc)
    return acc


def avg_pre_scale(count: int) -> float:
    """2^-m for the smallest power of two 2^m >= count: a sum of `count` inputs each pre-multiplied by it is
    at most the largest input (so it cannot overflow), and the multiplication is exact in the normal range."""
    return 2.0 ** -(count - 1).bit_length()


def divide_mean_(acc: torch.Tensor, count: int, pre_scale: float = 1.0) -> torch.Tensor:
    """A sum of `count` members' inputs, each pre-multiplied by `pre_scale`, to their mean, in place:
    integers round towards zero (as C's division in NCCL's ncclAvg: src/device/reduce_kernel.h,
    FuncSumPostDiv). count * pre_scale is exact (a power of two times an integer); 1 costs nothing."""
    divisor = count * pre_scale
    if divisor == 1:
        return acc
    if acc.dtype.is_floating_point or acc.dtype.is_complex:
        return acc.div_(divisor)
    return acc.div_(count, rounding_mode="trunc")
