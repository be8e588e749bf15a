"""`ThreadparProcessGroup`: a torch.distributed ProcessGroup whose ops run on a threadpar group.

One object per rank and group, made by the `threadpar` c10d backend (backend.py) in the rank's thread; it
wraps the rank's threadpar `ProcessGroup` handle of the same ranks, so a torch group and the threadpar group
share one set of communicators (rendezvous and mailboxes on `threads`, NCCL communicators and comm streams
on `nccl`, gloo groups between processes on `hierarchical`), and the collective-order check, the stop on a
rank's failure and the timeouts naming missing ranks hold for torch's calls as for threadpar's.

c10d passes group ranks (`opts.rootRank`, `dstRank`); threadpar's handle takes global ranks: `_global`.
An op torch's Python API waits for at once (`async_op=False`: `opts.asyncOp` is False) runs on the calling
thread; any other is issued asynchronously (the threads backend runs it on the rank's comm worker, nccl
enqueues it on the comm stream), as c10d's ops are: FSDP2, DDP's reducer and DTensor overlap them with
computation and wait later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.comm.group import ProcessGroup as ThreadparGroup
from threadpar.errors import ConfigError
from threadpar.torch_dist.work import C10dWork, completed

BACKEND_NAME = "threadpar"

# torch's bitwise reductions, for a threadpar ReduceOp without them (reduced here after an all-gather).
_BITWISE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def _asynchronous(opts: Any) -> bool:
    """Whether the caller may wait later: torch.distributed's Python API says so in `opts.asyncOp` (False for
    `async_op=False`: it waits at once, so the op runs here, without a hand-off to the comm worker); C++
    callers (DDP's reducer, functional collectives) leave it at its default, True."""
    return opts is None or bool(getattr(opts, "asyncOp", True))


def premul_factor(reduce_op: Any) -> float | torch.Tensor:
    """The factor of a PREMUL_SUM ReduceOp (`dist._make_nccl_premul_sum(factor)`: a float or a one-element
    tensor). Read from the op's pickled state, `(RedOpType.PREMUL_SUM, factor)`, which every supported torch
    gives (ReduceOp's py::pickle in torch/csrc/distributed/c10d/init.cpp); the `factor` attribute exists
    only from torch 2.13 on."""
    return reduce_op.__getstate__()[1]


class _Op:
    """A c10d ReduceOp read once: threadpar's op (None if threadpar has none), the name, PREMUL_SUM's factor."""

    __slots__ = ("factor", "name", "native")

    def __init__(self, reduce_op: Any) -> None:
        kind = getattr(reduce_op, "op", reduce_op)  # a c10d ReduceOp holds its RedOpType in .op
        self.name = str(getattr(kind, "name", kind)).rsplit(".", 1)[-1].upper()
        self.factor = premul_factor(reduce_op) if self.name == "PREMUL_SUM" else None
        try:
            self.native: ReduceOp | None = ReduceOp.parse("SUM" if self.factor is not None else self.name)
        except ConfigError:
            if self.name not in _BITWISE:
                raise
            self.native = None


class ThreadparProcessGroup(dist.ProcessGroup):
    def __init__(self, handle: ThreadparGroup) -> None:
        super().__init__(handle.rank(), handle.size())  # type: ignore[call-arg]
        self._handle = handle
        self._stream_ordered = handle.stream_ordered
        self._group_name = ""
        self._group_desc = ""

    # identity ---------------------------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # c10d names a group after creating it; the base class keeps the name in a backend, which a Python
    # group has none of (C++ reaches these through PyProcessGroup's getGroupName/setGroupName overrides).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # c10d's backend queries -----------------------------------------------------------------------------------
    # torch.distributed asks a group for its backend of a device (`_get_backend`) to read what the backend
    # supports. The base class looks it up among the backends registered with `_register_backend`
    # (ProcessGroup::getBackend, torch/csrc/distributed/c10d/ProcessGroup.hpp) and raises RuntimeError for a
    # device it has none for; a group a backend's creator returns, as this one, has none registered. Callers
    # that read a capability either catch that error (distributed_c10d's `_abort_process_group`,
    # `_get_process_group_uid`) or, from torch 2.14, not: `batch_isend_irecv` reads
    # `getattr(group._get_backend(device), "supports_coalescing", False)` for every ProcessGroup subclass
    # (torch PRs #178906 and #186964: a Python group answers as its own backend). So this group is its own
    # backend for the devices it serves, and says what it does not support; other devices raise as c10d does.
    supports_coalescing = False  # batch_isend_irecv: one op at a time (threadpar's batch is comm/batch.py)
    supports_splitting = False  # split_group, init_process_group's eager connect
    supports_shrinking = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False  # FSDP2 allocates its buffers itself (_fsdp_collectives.ProcessGroupAllocMixin)

    def _get_backend(self, device: torch.device) -> ThreadparProcessGroup:  # type: ignore[override]
        kind = torch.device(device).type
        if kind not in dist.Backend.backend_capability.get(BACKEND_NAME, ()):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    @property
    def threadpar_group(self) -> ThreadparGroup:
        """The threadpar ProcessGroup handle this torch group runs on."""
        return self._handle

    def __repr__(self) -> str:
        h = self._handle
        return f"ThreadparProcessGroup('{h.name}', ranks={list(h.ranks)}, rank={h.rank()})"

    def _global(self, group_rank: int) -> int:
        return self._handle.ranks[group_rank]

    def _work(self, works: Sequence[Work | None], outputs: list[torch.Tensor], **kw: Any) -> C10dWork:
        return C10dWork(
            [w for w in works if w is not None], outputs, stream_ordered=self._stream_ordered, **kw
        )

    def _unsupported(self, op: str, why: str) -> NotImplementedError:
        return NotImplementedError(
            f"{op} on group '{self._handle.name}' (ranks {list(self._handle.ranks)}, torch.distributed backend "
            f"'{BACKEND_NAME}'): {why}"
        )

    # reductions -------------------------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:  # type: ignore[override]
        op = _Op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._allreduce(list(tensors), op, "allreduce", _asynchronous(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        op = _Op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._allreduce(list(tensors), op, "allreduce_coalesced", _asynchronous(opts))

    def _allreduce(self, tensors: list[torch.Tensor], op: _Op, name: str, asynchronous: bool) -> C10dWork:
        for t in tensors:
            if t.is_sparse:
                raise self._unsupported(name, "sparse tensors are not supported; pass a dense tensor")
        if op.native is None:
            for t in tensors:
                self._bitwise_all_reduce(t, op.name)
            return completed(tensors)
        if op.factor is not None:
            for t in tensors:
                t.mul_(op.factor)  # PREMUL_SUM: scale, then sum (in place: allreduce's input is its output)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        handle = self._handle
        works = [
            handle.all_reduce(ts[0], op.native, async_op=asynchronous)
            if len(ts) == 1
            else handle.all_reduce_coalesced(ts, op.native, async_op=asynchronous)
            for ts in by_dtype.values()
        ]
        # threadpar's all-reduce Work completes with its tensors: c10d's value when there is one Work.
        return self._work(works, tensors, same_future=True)

    def _bitwise_all_reduce(self, tensor: torch.Tensor, name: str) -> None:
        """BAND/BOR/BXOR where threadpar's ReduceOp lacks them: gather every member's tensor, fold in rank
        order (every member computes the same result)."""
        gathered = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self._handle.all_gather_into_tensor(gathered, tensor.contiguous())
        result = gathered[0]
        for other in gathered[1:]:
            result = _BITWISE[name](result, other)
        tensor.copy_(result)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> C10dWork:  # type: ignore[override]
        op = _Op(opts.reduceOp)
        dst = self._global(opts.rootRank)
        (tensor,) = tensors
        if op.native is None:
            copy = tensor.clone()
            self._bitwise_all_reduce(copy, op.name)
            if self.rank() == opts.rootRank:
                tensor.copy_(copy)
            return completed(tensors)
        if op.factor is not None:
            tensor.mul_(op.factor)
        return self._work(
            [self._handle.reduce(tensor, dst, op.native, async_op=_asynchronous(opts))], tensors
        )

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> C10dWork:
        op = _Op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        (output,), (inputs,) = outputs, input_lists
        if op.native is None:
            stacked = torch.stack([t.contiguous() for t in inputs])
            self._bitwise_all_reduce(stacked, op.name)
            output.copy_(stacked[self.rank()])
            return completed(outputs)
        if op.factor is not None:
            inputs = [t * op.factor for t in inputs]
        work = self._handle.reduce_scatter(output, list(inputs), op.native, async_op=_asynchronous(opts))
        return self._work([work], outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> C10dWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        op = _Op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if op.native is None:
            for output, input in zip(outputs, inputs, strict=True):
                whole = input.contiguous().clone()
                self._bitwise_all_reduce(whole, op.name)
                output.copy_(whole.view(self.size(), *output.shape)[self.rank()])
            return completed(outputs)
        works = []
        for output, input in zip(outputs, inputs, strict=True):
            if op.factor is not None:
                input = input * op.factor
            works.append(
                self._handle.reduce_scatter_tensor(output, input, op.native, async_op=_asynchronous(opts))
            )
        return self._work(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    # gathers and copies -----------------------------------------------------------------------------------------
    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        (outputs,), (tensor,) = output_lists, inputs
        return self._work([self._handle.all_gather(outputs, tensor, async_op=_asynchronous(opts))], outputs)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        works = [
            self._handle.all_gather(outputs, tensor, async_op=_asynchronous(opts))
            for outputs, tensor in zip(output_lists, inputs, strict=True)
        ]
        return self._work(works, [t for outputs in output_lists for t in outputs])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> C10dWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> C10dWork:
        works = [
            self._handle.all_gather_into_tensor(output, input, async_op=_asynchronous(opts))
            for output, input in zip(outputs, inputs, strict=True)
        ]
        return self._work(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> C10dWork:  # type: ignore[override]
        (tensor,) = tensors
        work = self._handle.broadcast(tensor, self._global(opts.rootRank), async_op=_asynchronous(opts))
        return self._work([work], tensors)

    def gather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> C10dWork:
        (tensor,) = inputs
        is_root = self.rank() == opts.rootRank
        outputs = output_lists[0] if is_root and output_lists else None
        work = self._handle.gather(tensor, outputs, self._global(opts.rootRank), async_op=_asynchronous(opts))
        return self._work([work], list(outputs or []))

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any
    ) -> C10dWork:
        (tensor,) = outputs
        is_root = self.rank() == opts.rootRank
        chunks = input_lists[0] if is_root and input_lists else None
        work = self._handle.scatter(tensor, chunks, self._global(opts.rootRank), async_op=_asynchronous(opts))
        return self._work([work], outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> C10dWork:
        return self._work([self._handle.all_to_all(outputs, inputs, async_op=_asynchronous(opts))], outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | torch.Tensor,
        input_split_sizes: list[int] | torch.Tensor,
        opts: Any = None,
    ) -> C10dWork:
        # Split sizes come as c10d passes them: lists, or the caller's tensors (torch.distributed passes
        # those through); ProcessGroup reads both, and an empty list as "split evenly", as c10d does.
        work = self._handle.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, async_op=_asynchronous(opts)
        )
        return self._work([work], [output])

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> C10dWork:
        return self._work([self._handle.barrier(async_op=_asynchronous(opts))], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        # threadpar's own barrier already names the ranks that did not arrive when it times out.
        self._handle.barrier()

    # point to point ---------------------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> C10dWork:
        (tensor,) = tensors
        return self._work([self._handle.isend(tensor, self._global(dst), tag)], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> C10dWork:
        (tensor,) = tensors
        # threadpar's irecv matches messages in posting order, as c10d does.
        work = self._handle.irecv(tensor, self._global(src), tag)
        return self._work([work], tensors, source=lambda: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> C10dWork:
        (tensor,) = tensors
        work = self._handle.irecv(tensor, None, tag)
        group = self._handle
        return self._work([work], tensors, source=lambda: group.group_rank(work.result()))

    # what threadpar does not do ---------------------------------------------------------------------------------
    def allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any = None) -> C10dWork:
        raise self._unsupported("allreduce_sparse", "sparse tensors are not supported; pass a dense tensor")
