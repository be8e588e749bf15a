"""The cross-process step of the hierarchical backend: gloo collectives on raw process groups.

One thread per process (and lane) calls these on a `ProcessGroupGloo` whose ranks are processes. They work
in place on contiguous tensors, stage CUDA tensors through host memory, and wait in a way that a stop of
the launch (or a failure of the same collective elsewhere) interrupts. Reductions gloo cannot do (bool,
int16, complex products) fall back to an all-gather of the bytes and a reduction in process order, so
every process computes the same result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm.abort import AbortSignal
from threadpar.comm.fastcopy import copy_into
from threadpar.comm.reduce_op import ReduceOp, accumulate_
from threadpar.comm.router import as_bytes
from threadpar.errors import CollectiveTimeoutError

# How often a waiter looks at the stop signal and the cancellation test (completion wakes it at once).
POLL_S = 0.1

GLOO_REDUCE_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64,
}  # fmt: skip
_GLOO_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}

Wait = Callable[[Any], None]  # waits for one gloo Work


class Cancelled(Exception):
    """A wait given up because the collective already failed (e.g. a mismatch found by another check)."""


def wait_work(
    work: Any,
    *,
    abort: AbortSignal,
    timeout: float,
    describe: Callable[[], str],
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Wait for a gloo Work; raise RankAborted on a stop, Cancelled, or a timeout naming the call."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    deadline = time.monotonic() + timeout
    while not done.wait(POLL_S):
        abort.raise_if_set()
        if cancelled is not None and cancelled():
            raise Cancelled
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(describe())
    work.wait()  # raises gloo's error, if any


def gloo_can_reduce(dtype: torch.dtype, op: ReduceOp) -> bool:
    if dtype.is_complex:
        return op is ReduceOp.SUM  # as real pairs
    return dtype in GLOO_REDUCE_DTYPES


def _on_host(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The tensors in host memory, and a function that copies them back where they came from."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors), lambda: None
    host = [t.cpu() for t in tensors]
    return host, lambda: [copy_into(t, h) for t, h in zip(tensors, host)]


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
        parts = all_gather(pg, as_bytes(joined), wait)
        values = [row.view(dtype) for row in parts.unbind(0)]
        accumulate_(values[0], values[1:], op, len(values))
        offset = 0
        for t in host:
            copy_into(t.view(-1), values[0][offset : offset + t.numel()])
            offset += t.numel()
    write_back()


def broadcast(pg: Any, tensor: torch.Tensor, root: int, wait: Wait) -> None:
    """Copy the contiguous `tensor` of process index `root` into the others' (any dtype: sent as bytes)."""
    if tensor.numel() == 0:
        return
    (host,), write_back = _on_host([tensor])
    options = dist.BroadcastOptions()
    options.rootRank = root
    wait(pg.broadcast([as_bytes(host)], options))
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
