"""The cross-process step of the hierarchical backend: gloo collectives on raw process groups.

One thread per process (and lane) calls these on a `ProcessGroupGloo` whose ranks are processes. They work
in place on contiguous tensors, stage CUDA tensors through host memory, and wait in a way that a stop of
the launch interrupts. Reductions gloo cannot do (bool, int16, complex products) fall back to an all-gather
of the bytes and a reduction in process order, so every process computes the same result.

Callers must have checked that every process makes the same call first: gloo aborts the whole process
(std::terminate) when the sizes of a collective differ between processes.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.fastcopy import copy_into
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.hierarchical.connect import GLOO_TIMED_OUT
from threadpar.errors import CollectiveTimeoutError

# How often a waiter looks at the stop signal (completion wakes it at once).
POLL = datetime.timedelta(milliseconds=100)

GLOO_REDUCE_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
# The options' reduceOp is a c10d ReduceOp (built from its RedOpType; pybind would also convert implicitly).
_GLOO_OP = {
    ReduceOp.SUM: dist.ReduceOp(dist.ReduceOp.SUM),
    ReduceOp.PRODUCT: dist.ReduceOp(dist.ReduceOp.PRODUCT),
    ReduceOp.MIN: dist.ReduceOp(dist.ReduceOp.MIN),
    ReduceOp.MAX: dist.ReduceOp(dist.ReduceOp.MAX),
    # gloo reduces integer dtypes bitwise (ProcessGroupGloo.cpp: band/bor/bxor); check_reducible has
    # already refused floating dtypes, and bool falls back to the byte gather below.
    ReduceOp.BAND: dist.ReduceOp(dist.ReduceOp.BAND),
    ReduceOp.BOR: dist.ReduceOp(dist.ReduceOp.BOR),
    ReduceOp.BXOR: dist.ReduceOp(dist.ReduceOp.BXOR),
}

Wait = Callable[[Any], None]  # waits for one gloo Work


def wait_work(work: Any, *, abort: AbortSignal, timeout: float, describe: Callable[[], str]) -> None:
    """Wait for a gloo Work (or a gloo group's `Connecting`); raise RankAborted on a stop, or a timeout
    naming the call.

    Work.wait with a timeout leaves the operation running when it expires (unlike gloo's own timeout,
    which closes the connections), and nothing is left registered on the Work: an operation that a stop
    leaves pending must not call back into Python later, perhaps while the interpreter shuts down."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError as error:
            if GLOO_TIMED_OUT not in str(error):
                raise  # gloo's own error
        abort.raise_if_set()
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(describe())


def reduce_rows(rows: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """A new tensor: `rows` (one per process, same shape and dtype) reduced in process order."""
    acc = rows[0].clone()
    accumulate_(acc, rows[1:], op, len(rows))
    return acc


def gloo_can_reduce(dtype: torch.dtype, op: ReduceOp) -> bool:
    if dtype.is_complex:
        return op is ReduceOp.SUM  # as real pairs
    return dtype in GLOO_REDUCE_DTYPES


def _on_host(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The tensors in host memory, and a function that copies them back where they came from."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors), lambda: None
    host = [t.cpu() for t in tensors]

    def write_back() -> None:
        for t, h in zip(tensors, host):
            copy_into(t, h)

    return host, write_back


def all_reduce(pg: Any, tensors: Sequence[torch.Tensor], op: ReduceOp, wait: Wait) -> None:
    """Reduce contiguous tensors of one dtype across the processes of `pg`, in place. `op` is not AVG
    (the caller sums and divides once, by the size of the whole group)."""
    if not tensors or all(t.numel() == 0 for t in tensors):
        return
    host, write_back = _on_host(tensors)
    dtype = host[0].dtype
    if gloo_can_reduce(dtype, op):
        flat = [torch.view_as_real(t) if dtype.is_complex else t for t in host]
        if len(flat) == 1:
            options = dist.AllreduceOptions()
            options.reduceOp = _GLOO_OP[op]
            wait(pg.allreduce(flat, options))
        else:
            options = dist.AllreduceCoalescedOptions()
            options.reduceOp = _GLOO_OP[op]
            wait(pg.allreduce_coalesced(flat, options))
    else:
        joined = host[0].reshape(-1) if len(host) == 1 else torch.cat([t.reshape(-1) for t in host])
        parts = all_gather(pg, byte_view(joined), wait)
        result = reduce_rows([row.view(dtype) for row in parts.unbind(0)], op)
        offset = 0
        for t in host:
            copy_into(t.view(-1), result[offset : offset + t.numel()])
            offset += t.numel()
    write_back()


def broadcast(pg: Any, tensor: torch.Tensor, root: int, wait: Wait) -> None:
    """Copy the contiguous `tensor` of process index `root` into the others' (any dtype: sent as bytes)."""
    if tensor.numel() == 0:
        return
    (host,), write_back = _on_host([tensor])
    options = dist.BroadcastOptions()
    options.rootRank = root
    wait(pg.broadcast([byte_view(host)], options))
    if pg.rank() != root:
        write_back()


def all_gather(pg: Any, data: torch.Tensor, wait: Wait) -> torch.Tensor:
    """Every process's flat uint8 `data` (equal sizes), as a [processes, bytes] tensor."""
    out = torch.empty(pg.size(), data.numel(), dtype=torch.uint8)
    if data.numel():
        wait(pg.allgather([list(out.unbind(0))], [data.cpu()]))
    return out


def all_to_all(
    pg: Any, out: torch.Tensor, data: torch.Tensor, out_splits: list[int], in_splits: list[int], wait: Wait
) -> None:
    """Flat uint8 all-to-all with per-process byte counts (in_splits[q] bytes of `data` go to process q).
    Always called by every process: one with nothing to move cannot know that the others have nothing."""
    wait(pg.alltoall_base(out, data, out_splits, in_splits, dist.AllToAllOptions()))
