"""The nccl backend's collectives, as one member issues its part (mixed into NcclGroup, group.py).

Each is one NCCL call on the member's communicator, or for scatter, gather and all_to_all one NCCL group of
ncclSend/ncclRecv as torch builds them (torch/csrc/cuda/nccl.cpp: scatter and gather send to and receive
from every other rank inside ncclGroupStart/End and copy the root's own chunk locally; zero-size chunks are
sent too, never skipped, so that every rank's calls match). Staging (contiguous copies, concatenation,
AVG's division, copies back) runs on the operation's stream, before or after the call. A barrier is an
all-reduce of one element whose completion the host waits for (torch's ProcessGroupNCCL::barrier).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.common.call_ledger import CallLedger
from threadpar.comm.common.cuda_seam import CudaApi, NcclApi
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_, divide_mean_
from threadpar.comm.common.rendezvous import Call
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.nccl.comm import ScaledSumIssue
from threadpar.comm.nccl.library import SUM, nccl_group
from threadpar.comm.nccl.reduction import (
    PRE_MUL_SUM,
    NcclFeatures,
    contiguous_span,
    flat,
    nccl_reduction,
    wire,
)
from threadpar.comm.nccl.work import NcclWork


def all_to_all_sizes(calls: list[Call], members: list[int]) -> str | None:
    """Calls of all_to_all go together when what member s sends to m is what m expects from s (`calls[i]`
    is member `members[i]`'s: the members whose calls are at hand)."""
    sends = [dict(c.extra)["send"] for c in calls]
    recvs = [dict(c.extra)["recv"] for c in calls]
    wrong = [
        f"  rank index {m} expects {recvs[i][s]} elements from rank index {s}, which sends {sends[j][m]}"
        for i, m in enumerate(members)
        for j, s in enumerate(members)
        if recvs[i][s] != sends[j][m]
    ]
    if not wrong:
        return None
    return "output_tensor_list[i] must hold what rank i puts at this rank's index:\n" + "\n".join(wrong)


class NcclCollectives:
    """Declared for the type checker; NcclGroup sets or defines them."""

    name: str
    ranks: tuple[int, ...]
    size: int
    devices: tuple[torch.device, ...]
    ledger: CallLedger
    _cuda: CudaApi
    _nccl: NcclApi
    _features: NcclFeatures
    _timeout: float
    _op_stream: Callable[[int, bool], Any]
    _on: Callable[[Any, bool], contextlib.AbstractContextManager[Any]]
    _issue: Callable[..., None]
    _enter: Callable[[int, int, Call], None]
    _finish: Callable[..., NcclWork | None]
    _check_devices: Callable[[int, str, Sequence[torch.Tensor]], None]

    # reductions -------------------------------------------------------------------------------------------------
    def _reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        inp: torch.Tensor,
        out: torch.Tensor,
        op: ReduceOp,
        stream: Any,
        async_op: bool,
        kind: str,
        root: int = 0,
    ) -> None:
        """The reduction core, 1-D contiguous tensors. kind "all": out = reduce(everyone's inp); "root": the
        root's out = reduce(inp); "scatter": out = reduce(inp)[this member's 1/size]."""
        how = nccl_reduction(inp.dtype, op, self._features, self.size)
        if inp.numel() == 0:
            self._enter(member, seq, call)
            return
        if how.gather:
            self._gather_reduce(member, seq, call, inp, out, op, stream, async_op, kind, root)
            return
        win, wout, nccl = wire(inp, how), wire(out, how), self._nccl
        result = wout if kind != "root" or member == root else None  # (NCCL reads no recvbuff elsewhere)

        def call_nccl(h: Any, nop: int) -> None:
            if kind == "all":
                nccl.all_reduce(win, wout, nop, h, stream)
            elif kind == "root":
                nccl.reduce(win, result, root, nop, h, stream)
            else:
                nccl.reduce_scatter(win, wout, nop, h, stream)

        if how.nccl_op == PRE_MUL_SUM:  # the communicator's own op (comm.py makes it at its first use)
            self._issue(member, seq, call, stream, ScaledSumIssue(win.dtype, how.pre_scale, call_nccl))
        else:
            self._issue(member, seq, call, stream, lambda h: call_nccl(h, how.nccl_op))
        if how.divide and result is not None:  # AVG as a (pre-scaled) SUM: divide on the stream
            with self._on(stream, async_op):
                divide_mean_(out, self.size, how.pre_scale)

    def _gather_reduce(
        self, member, seq, call, inp, out, op: ReduceOp, stream, async_op: bool, kind: str, root: int
    ) -> None:
        """For dtypes/ops NCCL cannot reduce: all-gather the bytes, then reduce in rank order on the stream."""
        P, n = self.size, inp.numel()
        with self._on(stream, async_op):
            stage = torch.empty(P * inp.nbytes, dtype=torch.uint8, device=inp.device)
        data, nccl = byte_view(inp), self._nccl
        self._issue(member, seq, call, stream, lambda h: nccl.all_gather(data, stage, h, stream))
        if kind == "root" and member != root:
            return
        rows = stage.view(inp.dtype).view(P, n)  # rows[s] = member s's input
        if kind == "scatter":
            step = n // P
            rows = rows[:, member * step : (member + 1) * step]
        with self._on(stream, async_op):
            out.copy_(rows[0])
            accumulate_(out, list(rows[1:]), op, P)

    def all_reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> NcclWork | None:
        """`tensors`: this member's contiguous tensors (several for a coalesced all-reduce: one buffer)."""
        self._check_devices(member, call.op, tensors)
        stream = self._op_stream(member, async_op)
        if len(tensors) == 1:
            buf = flat(tensors[0])
        else:
            with self._on(stream, async_op):
                buf = torch.cat([flat(t) for t in tensors])
        self._reduce(member, seq, call, buf, buf, op, stream, async_op, "all")
        if len(tensors) > 1:
            with self._on(stream, async_op):
                torch._foreach_copy_(
                    [flat(t) for t in tensors], list(buf.split([t.numel() for t in tensors]))
                )
        return self._finish(member, seq, call, stream, tensors, async_op)

    def reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp,
        async_op: bool = False,
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [tensor])
        stream = self._op_stream(member, async_op)
        buf = flat(tensor)
        self._reduce(member, seq, call, buf, buf, op, stream, async_op, "root", root=dst)
        return self._finish(member, seq, call, stream, [tensor], async_op)

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [output, *inputs])
        stream = self._op_stream(member, async_op)
        with self._on(stream, async_op):
            whole = contiguous_span(inputs)  # reduce_scatter_tensor: the input is already one buffer
            if whole is None:
                whole = torch.cat([flat(p) for p in inputs])
            staged = output if output.is_contiguous() else output.contiguous()
        self._reduce(member, seq, call, whole, flat(staged), op, stream, async_op, "scatter")
        if staged is not output:
            with self._on(stream, async_op):
                output.copy_(staged)
        return self._finish(member, seq, call, stream, [output, whole], async_op)

    # data movement ----------------------------------------------------------------------------------------------
    def broadcast(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int, async_op: bool = False
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [tensor])
        stream = self._op_stream(member, async_op)
        if tensor.numel() == 0:
            self._enter(member, seq, call)
        else:
            data, nccl = byte_view(tensor), self._nccl
            self._issue(member, seq, call, stream, lambda h: nccl.broadcast(data, data, src, h, stream))
        return self._finish(member, seq, call, stream, [tensor], async_op)

    def all_gather(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [tensor, *outputs])
        stream = self._op_stream(member, async_op)
        if tensor.numel() == 0:
            self._enter(member, seq, call)
            return self._finish(member, seq, call, stream, [tensor], async_op)
        with self._on(stream, async_op):
            source = byte_view(tensor if tensor.is_contiguous() else tensor.contiguous())
            whole = contiguous_span(outputs)  # all_gather_into_tensor: gather straight into the output
            staged = whole is None
            if whole is None:
                whole = torch.empty(self.size * tensor.nbytes, dtype=torch.uint8, device=tensor.device)
        target, nccl = byte_view(whole), self._nccl
        self._issue(member, seq, call, stream, lambda h: nccl.all_gather(source, target, h, stream))
        if staged:  # separate output tensors: copy the chunks out on the stream
            chunks = target.view(tensor.dtype).view(self.size, *tensor.shape)
            with self._on(stream, async_op):
                torch._foreach_copy_(list(outputs), list(chunks.unbind(0)))
        return self._finish(member, seq, call, stream, [tensor, *outputs, whole], async_op)

    def barrier(
        self, member: int, seq: int, call: Call, timeout: float | None = None, async_op: bool = False
    ) -> NcclWork | None:
        """An all-reduce of one element; the host waits until the device has run it, which needs every
        member's (torch's barrier: an all-reduce, then a synchronize of the current stream)."""
        stream = self._op_stream(member, True)
        with self._on(stream, True):
            one = torch.zeros(1, dtype=torch.int32, device=self.devices[member])
        nccl = self._nccl
        self._issue(member, seq, call, stream, lambda h: nccl.all_reduce(one, one, SUM, h, stream))
        work = self._finish(member, seq, call, stream, [one], True, blocking=True)
        assert work is not None  # (asynchronous: it has one)
        if async_op:
            return work
        work.wait(timeout)
        return None

    # on the members' point-to-point connections ----------------------------------------------------------------
    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
        async_op: bool = False,
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [tensor, *(chunks or [])])
        stream = self._op_stream(member, async_op)
        nccl, peers = self._nccl, [m for m in range(self.size) if m != src]
        with self._on(stream, async_op):
            staged = (
                tensor
                if tensor.is_contiguous()
                else torch.empty_like(tensor, memory_format=torch.contiguous_format)
            )
            sources = (
                [c if c.is_contiguous() else c.contiguous() for c in chunks] if chunks is not None else []
            )
        received = byte_view(staged)
        sent = [byte_view(c) for c in sources]

        def issue(h: Any) -> None:
            with nccl_group(nccl):
                if member == src:
                    for m in peers:
                        nccl.send(sent[m], m, h, stream)
                else:
                    nccl.recv(received, src, h, stream)

        self._issue(member, seq, call, stream, issue, frozenset((src, m) for m in peers))
        with self._on(stream, async_op):
            if member == src:
                staged.copy_(sources[src])  # its own chunk: a local copy, as torch does
            if staged is not tensor:
                tensor.copy_(staged)
        return self._finish(member, seq, call, stream, [tensor, staged, *sources], async_op)

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
        async_op: bool = False,
    ) -> NcclWork | None:
        self._check_devices(member, call.op, [tensor, *(outputs or [])])
        stream = self._op_stream(member, async_op)
        nccl, peers = self._nccl, [m for m in range(self.size) if m != dst]
        with self._on(stream, async_op):
            source = tensor if tensor.is_contiguous() else tensor.contiguous()
            targets = (
                [
                    o if o.is_contiguous() else torch.empty_like(o, memory_format=torch.contiguous_format)
                    for o in outputs
                ]
                if outputs is not None
                else []
            )
        sent = byte_view(source)
        received = [byte_view(t) for t in targets]

        def issue(h: Any) -> None:
            with nccl_group(nccl):
                if member == dst:
                    for m in peers:
                        nccl.recv(received[m], m, h, stream)
                else:
                    nccl.send(sent, dst, h, stream)

        self._issue(member, seq, call, stream, issue, frozenset((m, dst) for m in peers))
        if outputs is not None:
            with self._on(stream, async_op):
                targets[dst].copy_(source)  # its own: a local copy, as torch does
                _copy_back(outputs, targets)
        return self._finish(member, seq, call, stream, [tensor, source, *(outputs or []), *targets], async_op)

    def all_to_all(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        async_op: bool = False,
    ) -> NcclWork | None:
        """outputs[s] on member m receives inputs[m] of member s (every member sends to and receives from
        every other inside one NCCL group, as torch's all2all; its own part is a local copy)."""
        self._check_devices(member, call.op, [*outputs, *inputs])
        sizes = call._replace(
            extra=(
                *call.extra,
                ("send", tuple(t.numel() for t in inputs)),
                ("recv", tuple(t.numel() for t in outputs)),
            )
        )
        stream = self._op_stream(member, async_op)
        nccl, peers = self._nccl, [m for m in range(self.size) if m != member]
        with self._on(stream, async_op):
            sources, targets = _staged(inputs, outputs)
        sent, received = [byte_view(t) for t in sources], [byte_view(t) for t in targets]

        def issue(h: Any) -> None:
            with nccl_group(nccl):
                for m in peers:
                    nccl.send(sent[m], m, h, stream)
                    nccl.recv(received[m], m, h, stream)

        everyone = frozenset((a, b) for a in range(self.size) for b in range(self.size) if a != b)
        self._issue(member, seq, call, stream, issue, everyone, checked=sizes)
        with self._on(stream, async_op):
            targets[member].copy_(sources[member])
            _copy_back(outputs, targets)
        return self._finish(member, seq, call, stream, [*inputs, *outputs, *sources, *targets], async_op)

    def permute(
        self,
        member: int,
        seq: int,
        call: Call,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        src_dst: list[int],
        async_op: bool = False,
    ) -> NcclWork | None:
        """One NCCL group per member: ncclSend of each input to src_dst[member], ncclRecv of each output from
        the member that sends here (a member sending to itself copies). Its pairs are connected the first time
        (a meeting, as every op that sends between members: `_issue`), after which a ring's shift is a
        collective of the group's own communicator with no host meeting."""
        self._check_devices(member, call.op, [*inputs, *outputs])
        stream = self._op_stream(member, async_op)
        dst, src = src_dst[member], src_dst.index(member)
        nccl = self._nccl
        with self._on(stream, async_op):
            sources, targets = _staged(inputs, outputs)
        sent, received = [byte_view(t) for t in sources], [byte_view(t) for t in targets]

        def issue(h: Any) -> None:
            if dst == member:
                return  # (nothing crosses: the copy below)
            with nccl_group(nccl):
                for x in sent:
                    nccl.send(x, dst, h, stream)
                for y in received:
                    nccl.recv(y, src, h, stream)

        pairs = frozenset((m, d) for m, d in enumerate(src_dst) if m != d)
        self._issue(member, seq, call, stream, issue, pairs)
        with self._on(stream, async_op):
            if dst == member:
                torch._foreach_copy_(targets, sources)
            _copy_back(outputs, targets)
        return self._finish(member, seq, call, stream, [*inputs, *outputs, *sources, *targets], async_op)

    def connect(self, member: int, seq: int, call: Call, pairs: frozenset[tuple[int, int]]) -> None:
        """One byte across each of the member's pairs, in one NCCL group: the first use of a pair connects it
        (after a meeting of the members, on a connector: `_issue`); exchange.py then finds it connected."""
        nccl, device = self._nccl, self.devices[member]
        stream = self._op_stream(member, False)
        peers_out = sorted(b for a, b in pairs if a == member)
        peers_in = sorted(a for a, b in pairs if b == member)
        ping = torch.zeros(len(peers_out), dtype=torch.uint8, device=device)
        pong = torch.empty(len(peers_in), dtype=torch.uint8, device=device)

        def issue(h: Any) -> None:
            with nccl_group(nccl):
                for i, peer in enumerate(peers_out):
                    nccl.send(ping[i : i + 1], peer, h, stream)
                for i, peer in enumerate(peers_in):
                    nccl.recv(pong[i : i + 1], peer, h, stream)

        self._issue(member, seq, call, stream, issue, pairs)


def _staged(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Contiguous tensors NCCL reads and writes as bytes: the inputs (copied where strided) and buffers for the
    outputs (new where strided; `_copy_back` returns them)."""
    sources = [t if t.is_contiguous() else t.contiguous() for t in inputs]
    targets = [
        o if o.is_contiguous() else torch.empty_like(o, memory_format=torch.contiguous_format)
        for o in outputs
    ]
    return sources, targets


def _copy_back(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Each output whose bytes went to a staging buffer (`_staged`) takes them."""
    for out, staged in zip(outputs, targets):
        if staged is not out:
            out.copy_(staged)
