"""The NCCL double's user-created reductions: ncclRedOpCreatePreMulSum and ncclRedOpDestroy, and the check every
reducing collective makes of its ncclRedOp_t. Each rule with the NCCL source it mirrors (NVIDIA/nccl):

- A user op is an index into its communicator's table (comm->userRedOps, a free list that starts at 4 slots and
  doubles; a freed slot is pushed on its head: src/enqueue.cc, ncclRedOpCreatePreMulSum / ncclRedOpDestroy),
  returned as ncclNumOps + index scrambled by a hash of the communicator's address (src/include/comm.h,
  ncclUserRedOpMangle, its own inverse): the same index on two communicators is two different handles.
- ncclRedOpCreatePreMulSum with ncclScalarHostImmediate copies ncclTypeSize(datatype) bytes of the scalar: the
  scalar is held in the data type (rounded to it). It first waits for a nonblocking communicator's init
  (ncclCommEnsureReady).
- A collective given an op: outside [0, ncclMaxRedOp] is "invalid reduction operation"; a user op whose slot is
  not allocated on this communicator (never made, destroyed, or made on another communicator) is "reduction
  operation %d unknown to this communicator" (src/misc/argcheck.cc, ArgsCheck); one made for another datatype
  is "Data type supplied to user-created ncclRedOp_t does not match type given to reduction operation" (src/
  enqueue.cc, hostToDevRedOp). All three are ncclInvalidArgument.
- ncclRedOpDestroy: a built-in op, garbage, or an op unknown to the communicator is ncclInvalidArgument.
- ncclCommDestroy and ncclCommAbort free the table with the communicator (src/init.cc, commFree:
  `delete[] comm->userRedOps`): nothing needs destroying first.
The math of a pre-multiplied sum is fake_nccl_math.py's.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from .fake_nccl_math import INVALID_ARGUMENT, nccl_error

NUM_OPS = 5  # ncclNumOps (nccl.h): the built-in ncclRedOp_t values are 0..4
MAX_RED_OP = 0x7FFFFFFF  # ncclMaxRedOp for a 4-byte enum (nccl.h)
PRE_MUL_SUM = "PreMulSum"  # the device op a user op runs (ncclDevPreMulSum): what every rank's call compares
FIRST_VERSION = (2, 11)  # nccl.h of v2.11 first declares ncclRedOpCreatePreMulSum


class UserOp(NamedTuple):
    dtype: torch.dtype
    scalar: torch.Tensor  # 0-dim, in `dtype`


def mangle(address: int, op: int) -> int:
    """src/include/comm.h, ncclUserRedOpMangle (its own inverse), for a communicator at `address`."""
    if op < NUM_OPS:
        return op
    h = address ^ (address >> 32)
    h = (h * 0x9E3779B97F4A7C13) & 0xFFFFFFFFFFFFFFFF
    h = (h >> 32) & MAX_RED_OP
    op1 = h ^ op
    return op if op1 < NUM_OPS else op1


class UserRedOps:
    """The tables of one simulated process's communicators, keyed (clique, rank); `addresses` gives each its
    own stand-in for the ncclComm_t pointer the handles are scrambled with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[Any, list[UserOp | None]] = {}  # key -> slots (None: free)
        self._free: dict[Any, list[int]] = {}  # key -> free slots, the head last
        self._addresses: dict[Any, int] = {}

    def _address(self, key: Any) -> int:
        if key not in self._addresses:
            self._addresses[key] = 0x7F3A_0000_0000 + 0x10_0000 * len(self._addresses)
        return self._addresses[key]

    def create(self, key: Any, scalar: float, dtype: torch.dtype) -> int:
        with self._lock:
            table = self._tables.setdefault(key, [])
            free = self._free.setdefault(key, [])
            if not free:  # grow: at least 4 slots, then double (src/enqueue.cc)
                capacity = max(4, 2 * len(table))
                free.extend(reversed(range(len(table), capacity)))
                table.extend([None] * (capacity - len(table)))
            ix = free.pop()
            table[ix] = UserOp(dtype, torch.tensor(scalar, dtype=torch.float64).to(dtype))
            return mangle(self._address(key), NUM_OPS + ix)

    def destroy(self, key: Any, op: int) -> None:
        if 0 <= op < NUM_OPS:
            raise nccl_error("ncclRedOpDestroy", INVALID_ARGUMENT, "operator is a NCCL builtin.")
        if not 0 <= op <= MAX_RED_OP:
            raise nccl_error("ncclRedOpDestroy", INVALID_ARGUMENT, "operator is garbage.")
        with self._lock:
            ix = self._slot(key, op)
            if ix is None:
                raise nccl_error(
                    "ncclRedOpDestroy", INVALID_ARGUMENT, "operator unknown to this communicator."
                )
            self._tables[key][ix] = None
            self._free[key].append(ix)

    def resolve(
        self, function: str, key: Any, op: int, dtype: torch.dtype
    ) -> tuple[int | str, UserOp | None]:
        """What a collective given `op` on the communicator `key` with data of `dtype` runs: a built-in op, or
        (PRE_MUL_SUM, its UserOp); raises what NCCL returns for a bad one."""
        if not 0 <= op <= MAX_RED_OP:
            raise nccl_error(function, INVALID_ARGUMENT, f"invalid reduction operation {op}")
        if op < NUM_OPS:
            return op, None
        with self._lock:
            ix = self._slot(key, op)
            user = None if ix is None else self._tables[key][ix]
        if user is None:
            raise nccl_error(
                function, INVALID_ARGUMENT, f"reduction operation {op} unknown to this communicator"
            )
        if user.dtype != dtype:
            raise nccl_error(
                function,
                INVALID_ARGUMENT,
                "Data type supplied to user-created ncclRedOp_t does not match type given to reduction operation "
                f"(made for {user.dtype}, given {dtype})",
            )
        return PRE_MUL_SUM, user

    def _slot(self, key: Any, op: int) -> int | None:
        """The allocated slot `op` names on `key`'s communicator, or None (the caller holds the lock)."""
        ix = mangle(self._address(key), op) - NUM_OPS
        table = self._tables.get(key, [])
        return ix if 0 <= ix < len(table) and table[ix] is not None else None

    def live(self, key: Any) -> list[UserOp]:
        with self._lock:
            return [u for u in self._tables.get(key, []) if u is not None]

    def forget(self, key: Any) -> None:
        """The communicator was freed, and its table with it (commFree)."""
        with self._lock:
            self._tables.pop(key, None)
            self._free.pop(key, None)
