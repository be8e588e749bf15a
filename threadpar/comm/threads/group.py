"""The `threads` backend: collectives between rank threads that read straight out of each other's tensors.

Every collective starts with a rendezvous where each member posts its tensors. The last member to arrive
sees all of them and picks the algorithm:

- small (at most SMALL_BYTES in all): it does the whole collective itself, writing every member's output
  while the others wait. One meeting, no extra allocation; latency is what matters at this size.
- large: each member does its 1/P share in parallel (torch ops and memmove release the GIL), then the
  members meet again so nobody returns, and reuses its tensors, while a peer still reads or writes them.
  An all-reduce of N bytes: member k reduces slice k of every member's tensor into its own slice k, in
  place, then writes it into the peers' slice k. Per member that reads about 2N and writes N bytes, and
  allocates nothing (fresh buffers cost page faults: a 64 MiB clone took 40 ms here, a copy 8 ms).

Each element is reduced once, by one member, in a fixed order, so every member gets bit-identical results,
run after run.
Inputs reach this module validated (by ProcessGroup). Tensors are CPU tensors, or CUDA tensors when several
ranks share a GPU: then a `StreamOrder` (stream_order.py) orders each cross-rank access with events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.exchange import exchange_by_messages
from threadpar.comm.common.fastcopy import copy_into
from threadpar.comm.common.mailbox import Mailboxes, Message
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_
from threadpar.comm.common.rendezvous import Call, Rendezvous, Slot
from threadpar.comm.common.tensor_bytes import pieces, split_range
from threadpar.comm.threads.stream_order import Fences, StreamOrder
from threadpar.errors import ConfigError

# Below this many bytes in a collective (all members together), one thread doing everything beats P
# threads splitting it: the second meeting costs more than the copies it parallelises.
SMALL_BYTES = 256 * 1024


class ThreadsGroup:
    """The shared state of one group on the `threads` backend; methods are called by each member."""

    stream_ordered = False  # ProcessGroup runs each op on the member's comm worker
    backend_name = "threads"

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        abort: AbortSignal,
        timeout: float,
        order: StreamOrder | None = None,
    ) -> None:
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rendezvous = Rendezvous(name, ranks, abort, timeout)
        self.mailboxes = Mailboxes(name, ranks, abort, timeout)
        self._order = order  # None on CPU

    def _meet(
        self, member: int, seq: int, call: Call, payload, payload_bytes: Callable, whole: Callable
    ) -> Slot:
        """Arrive; when the collective is small, the last arrival runs `whole(slot)` for everybody."""
        order = self._order
        if order is not None:
            payload = (payload, order.arrive(member))

        def leader(slot: Slot) -> bool:
            if order is not None:  # unwrap: the members' events go to slot.result
                slot.result = Fences([p[1] for p in slot.payloads])
                slot.payloads = [p[0] for p in slot.payloads]
            if self.size > 1 and sum(payload_bytes(p) for p in slot.payloads) > SMALL_BYTES:
                return False
            if order is not None:
                order.begin(slot.result)
            whole(slot)
            if order is not None:
                order.end(slot.result)
            return True

        slot = self.rendezvous.arrive(member, seq, call, payload, leader=leader)
        if order is not None:
            if slot.finished:
                order.leave(slot.result, member)
            else:
                order.begin(slot.result)  # this member's share follows
        return slot

    def _finish(self, slot: Slot, member: int, seq: int) -> None:
        if self._order is not None:
            self._order.end(slot.result)
        self.rendezvous.sync(slot, member, seq, final=True)
        if self._order is not None:
            self._order.leave(slot.result, member)

    # reductions -------------------------------------------------------------------------------------------------
    def all_reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> None:
        """`tensors`: this member's contiguous tensors (several for a coalesced all-reduce)."""
        P = self.size

        def whole(slot: Slot) -> None:
            for i in range(len(tensors)):
                parts = [slot.payloads[m][i] for m in range(P)]
                accumulate_(parts[0], parts[1:], op, P)
                for p in parts[1:]:
                    copy_into(p, parts[0])

        slot = self._meet(member, seq, call, tensors, lambda ts: sum(t.nbytes for t in ts), whole)
        if slot.finished:
            return
        flat = [[t.view(-1) for t in payload] for payload in slot.payloads]
        # Member k owns slice k of the concatenated tensors: nobody else reads or writes slice k of any
        # member's tensor. So it reduces the peers' slice k into its own in place, then writes the result
        # into the peers' slice k. No buffer, no second meeting; the last meeting keeps every member here
        # until the peers have written into its tensors.
        numels = [t.numel() for t in tensors]
        peers = [m for m in range(P) if m != member]
        for i, a, b in pieces(numels, *split_range(sum(numels), P)[member]):
            mine = flat[member][i][a:b]
            accumulate_(mine, [flat[m][i][a:b] for m in peers], op, P)
            for m in peers:
                copy_into(flat[m][i][a:b], mine)
        self._finish(slot, member, seq)

    def reduce(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        dst: int,
        op: ReduceOp,
        async_op: bool = False,
    ) -> None:
        P = self.size

        def whole(slot: Slot) -> None:
            accumulate_(slot.payloads[dst], [t for m, t in enumerate(slot.payloads) if m != dst], op, P)

        slot = self._meet(member, seq, call, tensor, lambda t: t.nbytes, whole)
        if slot.finished:
            return
        # As in all_reduce, slice k belongs to member k, which reduces it into dst's tensor.
        a, b = split_range(tensor.numel(), P)[member]
        flats = [t.view(-1) for t in slot.payloads]
        accumulate_(flats[dst][a:b], [t[a:b] for m, t in enumerate(flats) if m != dst], op, P)
        self._finish(slot, member, seq)

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
        async_op: bool = False,
    ) -> None:
        P = self.size

        def reduce_for(m: int, slot: Slot) -> None:
            out, own = slot.payloads[m][0], slot.payloads[m][1][m]
            if (
                out.data_ptr() != own.data_ptr()
            ):  # else reduce_scatter_tensor in place: `own` is already there
                copy_into(out, own)
            accumulate_(out, [slot.payloads[s][1][m] for s in range(P) if s != m], op, P)

        def whole(slot: Slot) -> None:
            for m in range(P):
                reduce_for(m, slot)

        slot = self._meet(member, seq, call, (output, inputs), lambda p: sum(t.nbytes for t in p[1]), whole)
        if slot.finished:
            return
        reduce_for(member, slot)
        self._finish(slot, member, seq)

    # copies -----------------------------------------------------------------------------------------------------
    def broadcast(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int, async_op: bool = False
    ) -> None:
        def whole(slot: Slot) -> None:
            for m, t in enumerate(slot.payloads):
                if m != src:
                    copy_into(t, slot.payloads[src])

        slot = self._meet(member, seq, call, tensor, lambda t: t.nbytes, whole)
        if slot.finished:
            return
        # Every member, the source included, copies its 1/P of the source into all the others: with one
        # copier per receiver a 2-rank broadcast would leave a core idle.
        a, b = split_range(tensor.numel(), self.size)[member]
        flats = [t.view(-1) for t in slot.payloads]
        for m, flat in enumerate(flats):
            if m != src:
                copy_into(flat[a:b], flats[src][a:b])
        self._finish(slot, member, seq)

    def all_gather(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
    ) -> None:
        P = self.size

        def gather_for(m: int, slot: Slot) -> None:
            for s in range(P):
                out, src = slot.payloads[m][0][s], slot.payloads[s][1]
                if s != m or out.data_ptr() != src.data_ptr():  # in place: this member's part is there
                    copy_into(out, src)

        def whole(slot: Slot) -> None:
            for m in range(P):
                gather_for(m, slot)

        slot = self._meet(member, seq, call, (outputs, tensor), lambda p: sum(t.nbytes for t in p[0]), whole)
        if slot.finished:
            return
        gather_for(member, slot)
        self._finish(slot, member, seq)

    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
        async_op: bool = False,
    ) -> None:
        def whole(slot: Slot) -> None:
            for m, (t, _) in enumerate(slot.payloads):
                copy_into(t, slot.payloads[src][1][m])

        slot = self._meet(member, seq, call, (tensor, chunks), lambda p: p[0].nbytes, whole)
        if slot.finished:
            return
        copy_into(tensor, slot.payloads[src][1][member])
        self._finish(slot, member, seq)

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
        async_op: bool = False,
    ) -> None:
        def whole(slot: Slot) -> None:
            for s, (t, _) in enumerate(slot.payloads):
                copy_into(slot.payloads[dst][1][s], t)

        slot = self._meet(member, seq, call, (tensor, outputs), lambda p: p[0].nbytes, whole)
        if slot.finished:
            return
        if member == dst:
            assert outputs is not None  # ProcessGroup.gather requires gather_list on dst
            for s, (t, _) in enumerate(slot.payloads):
                copy_into(outputs[s], t)
        self._finish(slot, member, seq)

    def all_to_all(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        async_op: bool = False,
    ) -> None:
        """outputs[s] on member m receives inputs[m] of member s."""
        P = self.size

        def receive(m: int, outs: list[torch.Tensor], slot: Slot) -> None:
            for s in range(P):
                sent = slot.payloads[s][1][m]
                if outs[s].shape != sent.shape:
                    raise ConfigError(
                        f"all_to_all on group '{self.name}': rank {self.ranks[m]} expects "
                        f"{list(outs[s].shape)} from rank {self.ranks[s]}, which sends {list(sent.shape)}; "
                        "output_tensor_list[i] must have the shape of what rank i puts at this rank's index"
                    )
                copy_into(outs[s], sent)

        def whole(slot: Slot) -> None:
            for m in range(P):
                receive(m, slot.payloads[m][0], slot)

        slot = self._meet(member, seq, call, (outputs, inputs), lambda p: sum(t.nbytes for t in p[1]), whole)
        if slot.finished:
            return
        receive(member, outputs, slot)
        self._finish(slot, member, seq)

    def permute(
        self,
        member: int,
        seq: int,
        call: Call,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        src_dst: list[int],
        async_op: bool = False,
    ) -> None:
        """outputs on member m receive the inputs of the member s with src_dst[s] == m."""
        source = {dst: src for src, dst in enumerate(src_dst)}

        def receive(m: int, outs: list[torch.Tensor], slot: Slot) -> None:
            for out, sent in zip(outs, slot.payloads[source[m]][1]):
                copy_into(out, sent)

        def whole(slot: Slot) -> None:
            for m in range(self.size):
                receive(m, slot.payloads[m][0], slot)

        slot = self._meet(member, seq, call, (outputs, inputs), lambda p: sum(t.nbytes for t in p[1]), whole)
        if slot.finished:
            return
        receive(member, outputs, slot)
        self._finish(slot, member, seq)

    def barrier(
        self, member: int, seq: int, call: Call, timeout: float | None = None, async_op: bool = False
    ) -> None:
        self.rendezvous.arrive(member, seq, call, None, final=True, timeout=timeout)

    # point to point ---------------------------------------------------------------------------------------------
    def exchange(
        self, member: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        exchange_by_messages(self, member, sends, recvs)

    def connect(self, member: int, seq: int, call: Call, pairs: frozenset[tuple[int, int]]) -> None:
        """Nothing to connect: messages are buffered."""

    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor, async_op: bool = False) -> None:
        # The message is a private copy: the sender may reuse its tensor as soon as send returns. It is made on
        # the receiver's device: ranks sharing GPUs may be on several, and recv_tensor hands the message itself
        # to the receiver (a cross-device copy, on the sender's stream: the receiver's waits for it below).
        device = tensor.device if self._order is None else self._order.devices[dst]
        message: Message = tensor.detach().to(device, copy=True, memory_format=torch.contiguous_format)
        if self._order is not None:  # on CUDA: the receiver's stream must wait for the copy
            message = (message, self._order.arrive(member))
        self.mailboxes.put(member, dst, tag, message)

    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]:
        got, message = self.mailboxes.take(member, src, tag, timeout)
        if self._order is not None:
            message, copied = message
            self._order.received(member, copied, message)
        return got, message

    def has_message(self, member: int, src: int | None, tag: int) -> bool:
        return self.mailboxes.has_message(member, src, tag)

    def close(self, failed: bool) -> None:
        """Nothing to let go of: the group's state is Python objects (the launch's, dropped with it)."""
