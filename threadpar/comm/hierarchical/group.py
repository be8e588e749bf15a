"""The hierarchical backend: collectives on a group whose member threads live in more than one process.

It has the method interface of `ThreadsGroup`, so `ProcessGroup` (validation, sequence numbers) is shared.
Each collective:

1. the members in this process meet at a local rendezvous (which checks they agree on the call);
2. one of them all-gathers a fixed-size control message from every process (call_check.py): all
   processes must describe the same call, else every rank raises CollectiveMismatchError. Small data rides
   in that message, and a small collective is finished right there, in one round trip;
3. otherwise leader threads move the data between processes over gloo (gloo_ops.py);
4. the results are shared with the local members, and they meet once more.

Large all-reduces and broadcasts use lanes: with L members in every process, local member j leads lane j,
a 1/L slice of the data with a gloo group of its own, so the lanes reduce and transfer in parallel. An
all-reduce is thus a local reduce-scatter, L parallel cross-process all-reduces and a local all-gather.
The other collectives have one leader, the member that arrived last at the local rendezvous (it is running;
the others are already waiting), and move bytes (any dtype). Each gloo group belongs to one threadpar group
and one use ("lane0", "control") and is created on first use, so independent groups never share a
torch.distributed group and never need a common order of calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.common import call_check
from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.exchange import exchange_by_messages
from threadpar.comm.common.fastcopy import copy_into
from threadpar.comm.common.mailbox import Mailboxes
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_
from threadpar.comm.common.rendezvous import Call, Rendezvous, Slot
from threadpar.comm.common.tensor_bytes import byte_view, pieces, split_range
from threadpar.comm.hierarchical import gloo_ops
from threadpar.comm.hierarchical.connect import Connecting
from threadpar.comm.hierarchical.copies import HierarchicalByteCollectives, concat_bytes
from threadpar.errors import RankAborted

# A lane gets at least this many bytes: below it, one more gloo call costs more than it saves.
LANE_MIN_BYTES = 1 << 20
INLINE_BYTES = call_check.INLINE_BYTES

Work = Callable[[gloo_ops.Wait, int], None]  # (wait, lane): a lane leader's share of a collective


def group_key(ranks: Sequence[int], timeout: float | None = None) -> int:
    """A stable 63-bit id of a group, the same in every process: its global ranks, and its own timeout (a
    group made by new_group(ranks, timeout=...) is another group of the same ranks, GroupRegistry)."""
    text = ",".join(map(str, ranks)) + ("" if timeout is None else f"@{timeout!r}")
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def describe_stuck(
    description: str,
    timeout: float,
    ranks: Sequence[int],
    procs: Sequence[int],
    members_by_proc: Sequence[Sequence[int]],
    arrived: dict[int, list[int] | None],
) -> str:
    """The timeout of a cross-process step, naming the ranks that did not arrive: `arrived[process]` is
    what that process said of its members (None: it did not answer)."""
    missing, silent, present = [], [], []
    for process, members in zip(procs, members_by_proc):
        theirs = [ranks[m] for m in members]
        answer = arrived.get(process)
        if answer is None:
            silent.append(f"process {process} (ranks {theirs}) did not answer")
            continue
        present += [r for r in theirs if r in answer]
        missing += [f"rank {r} (process {process})" for r in theirs if r not in answer]
    if missing:
        what = f"{', '.join(missing)} did not arrive"
    elif silent:
        what = "every rank that answered arrived"
    else:
        what = "every rank arrived, but the exchange between the processes did not complete"
    return (
        f"{description} timed out after {timeout:g} s: {'; '.join([what, *silent])} (waiting: ranks "
        f"{sorted(present)}). A rank that skips a collective, calls them in another order, or is stuck in a "
        "long computation causes this (a process that is stuck or dead too); raise the launch's timeout= if "
        "the computation is legitimately slow."
    )


# permute's messages use tags below this (user tags are small ints; the router carries 64-bit tags).
PERMUTE_TAG = -(1 << 62)


class HierarchicalGroup(HierarchicalByteCollectives):
    stream_ordered = False  # ProcessGroup runs each op on the member's comm worker
    backend_name = "hierarchical"

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        processes: Any,
        abort: AbortSignal,
        timeout: float,
        *,
        key: int | None = None,
        route_messages: bool = True,
    ) -> None:
        """`route_messages=False`: another object receives this group's messages from other processes
        (the nccl backend's spanning groups use this class for their collectives through host memory)."""
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self._processes = processes
        self._abort = abort
        self._timeout = timeout
        proc_of = [processes.process_of(r) for r in self.ranks]
        self.procs = tuple(sorted(set(proc_of)))
        self.me = self.procs.index(processes.rank)  # this process's index among the group's processes
        self.proc_index = [self.procs.index(p) for p in proc_of]  # member -> index of its process
        self.members_by_proc = [[m for m in range(self.size) if proc_of[m] == p] for p in self.procs]
        self.local = self.members_by_proc[self.me]
        self.local_index = {m: i for i, m in enumerate(self.local)}
        self.max_local = max(len(ms) for ms in self.members_by_proc)
        self.lanes = min(len(ms) for ms in self.members_by_proc)
        self.key = group_key(self.ranks) if key is None else key
        self.rendezvous = Rendezvous(
            name, [self.ranks[m] for m in self.local], abort, timeout, group_ranks=self.ranks
        )
        self.mailboxes = Mailboxes(name, self.ranks, abort, timeout)
        self._gloo: dict[str, Any] = {}
        if route_messages:
            processes.router.register(self.key, self.mailboxes, self.ranks)
        processes.register_group(self.key, self.rendezvous)  # it answers "who arrived?" from elsewhere

    # plumbing ---------------------------------------------------------------------------------------------------
    def _pg(self, which: str, wait: gloo_ops.Wait) -> Any:
        """This group's gloo group `which`, created on first use: the other processes are met under the
        collective's `wait` (a stop interrupts it, its timeout names the missing ranks: connect.py).
        A collective's steps never overlap, so at most one thread at a time uses (or creates) it."""
        pg = self._gloo.get(which)
        if pg is None:
            name = f"{self.key:x}/{which}"
            connecting = Connecting(name, lambda: self._processes.gloo_group(name, self.procs))
            wait(connecting)
            pg = self._gloo[which] = connecting.result()
        return pg

    def _lanes_for(self, nbytes: int) -> int:
        return max(1, min(self.lanes, nbytes // LANE_MIN_BYTES))

    def _arrive(
        self, member: int, seq: int, call: Call, payload: Any, timeout: float | None = None
    ) -> tuple[int, Slot]:
        li = self.local_index[member]

        def mark_last(slot: Slot) -> bool:  # run by the last member to arrive
            slot.shared[li] = True
            return False

        return li, self.rendezvous.arrive(li, seq, call, payload, leader=mark_last, timeout=timeout)

    def _step(
        self,
        slot: Slot,
        li: int,
        seq: int,
        call: Call,
        lanes: int,
        work: Work | None = None,
        *,
        payload: Callable[[], torch.Tensor] | None = None,
        inline: Callable[[torch.Tensor], None] | None = None,
        agree: Callable[[torch.Tensor], None] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Steps 2-4 of the module note. The checker (local member 0 when there are lanes, else the last
        arrival) sends `payload()` with the control message; if the calls agree, it finishes a small
        collective with `inline(payloads)` ([processes, INLINE_BYTES] uint8), or runs `agree(payloads)`
        (which may set slot.error) before the lane leaders (0..lanes-1, or the checker alone) run
        `work(wait, lane)`. Any error is raised on every local member. `timeout`: the call's own (barrier)
        for the wait for the other processes, else the group's."""
        limit = self._timeout if timeout is None else timeout
        last = slot.shared.index(True)
        checker = li == 0 if lanes > 1 else li == last
        lane = (li if li < lanes else None) if lanes > 1 else (0 if lanes == 1 and checker else None)
        description = f"{call} #{seq} on group '{self.name}' (global ranks {list(self.ranks)})"

        def wait(work_: Any) -> None:
            gloo_ops.wait_work(work_, abort=self._abort, timeout=limit, describe=stuck)

        def stuck() -> str:  # which ranks, in which processes, have not arrived: asked of every process
            arrived = self._processes.arrivals(
                self.key, seq, [p for p in self.procs if p != self.procs[self.me]]
            )
            arrived[self.procs[self.me]] = self.rendezvous.arrived(seq) or [self.ranks[m] for m in self.local]
            return describe_stuck(description, limit, self.ranks, self.procs, self.members_by_proc, arrived)

        def recorded(fn: Callable[[], None]) -> None:  # the first error goes to every local member
            try:
                fn()
            except RankAborted:
                raise
            except Exception as error:
                if slot.error is None:
                    slot.error = error

        def check() -> None:
            mine = call_check.control_message(seq, call, payload() if payload is not None else None)
            rows = gloo_ops.all_gather(self._pg("control", wait), mine, wait)
            slot.error = call_check.mismatch(self.name, self.ranks, self.procs, self.me, seq, rows)
            for examine in (inline, agree):
                if slot.error is None and examine is not None:
                    examine(call_check.payloads(rows))

        # A member in the cross-process step is busy for the group: the others wait for it (its wait is
        # bounded and names what it waited for) rather than time out first and blame it.
        if checker:
            with self.rendezvous.busy(slot, li):
                recorded(check)
        if lanes > 1:
            self.rendezvous.sync(slot, li, seq)  # the lane leaders start once the calls agree
        if slot.error is None and inline is None and lane is not None:
            assert work is not None, "_step: a collective without `inline` runs `work`"
            with self.rendezvous.busy(slot, li):
                recorded(lambda: work(wait, lane))
        if slot.error is not None and not isinstance(slot.error, str):
            # gloo operations of this group may be left pending: never destroy its gloo groups
            self._processes.abandon(list(self._gloo.values()))
        # (the group's timeout: the checker's own wait above is bounded by `limit` and ends this one)
        self.rendezvous.sync(slot, li, seq, final=True)

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
        li, slot = self._arrive(member, seq, call, tensors)
        numels = [t.numel() for t in tensors]
        nbytes = sum(t.nbytes for t in tensors)
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op  # divide once, by the whole group's size
        flat = [[t.view(-1) for t in payload] for payload in slot.payloads]
        others = [o for o in range(len(flat)) if o != li]

        def local_sum(i: int, a: int, b: int) -> torch.Tensor:  # into my own tensor
            acc = flat[li][i][a:b]
            accumulate_(acc, [flat[o][i][a:b] for o in others], inner, self.size)
            return acc

        def share(i: int, a: int, b: int, result: torch.Tensor) -> None:
            if op is ReduceOp.AVG:
                accumulate_(result, [], op, self.size)
            for o in range(len(flat)):
                copy_into(flat[o][i][a:b], result)

        if nbytes <= INLINE_BYTES:  # the local sums travel in the control message

            def inline(rows: torch.Tensor) -> None:
                dtype = tensors[0].dtype
                total = gloo_ops.reduce_rows([row[:nbytes].view(dtype) for row in rows], inner)
                offset = 0
                for i, n in enumerate(numels):
                    share(i, 0, n, total[offset : offset + n])
                    offset += n

            payload = lambda: concat_bytes([local_sum(i, 0, n) for i, n in enumerate(numels)])  # noqa: E731
            self._step(slot, li, seq, call, 1, payload=payload, inline=inline)
            return
        lanes = self._lanes_for(nbytes)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            parts = pieces(numels, *split_range(sum(numels), lanes)[lane])
            mine = [local_sum(i, a, b) for i, a, b in parts]  # this lane's slice of the local sum
            gloo_ops.all_reduce(self._pg(f"lane{lane}", wait), mine, inner, wait)
            for (i, a, b), result in zip(parts, mine):
                share(i, a, b, result)

        self._step(slot, li, seq, call, lanes, work)

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
        li, slot = self._arrive(member, seq, call, tensor)
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        dst_li = self.local_index.get(dst)
        flats = [t.view(-1) for t in slot.payloads]

        def local_sum(a: int, b: int) -> torch.Tensor:  # a new tensor: only dst's tensor may change
            acc = flats[li][a:b].clone()
            accumulate_(acc, [f[a:b] for o, f in enumerate(flats) if o != li], inner, self.size)
            return acc

        def deliver(a: int, b: int, result: torch.Tensor) -> None:
            if dst_li is not None:
                if op is ReduceOp.AVG:
                    accumulate_(result, [], op, self.size)
                copy_into(flats[dst_li][a:b], result)

        n, nbytes = tensor.numel(), tensor.nbytes
        if nbytes <= INLINE_BYTES:
            rows_of = lambda rows: [row[:nbytes].view(tensor.dtype) for row in rows]  # noqa: E731
            inline = lambda rows: deliver(0, n, gloo_ops.reduce_rows(rows_of(rows), inner))  # noqa: E731
            self._step(slot, li, seq, call, 1, payload=lambda: byte_view(local_sum(0, n)), inline=inline)
            return
        lanes = self._lanes_for(nbytes)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            a, b = split_range(n, lanes)[lane]
            acc = local_sum(a, b)
            gloo_ops.all_reduce(self._pg(f"lane{lane}", wait), [acc], inner, wait)
            deliver(a, b, acc)

        self._step(slot, li, seq, call, lanes, work)

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
        li, slot = self._arrive(member, seq, call, (output, inputs))
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        n = output.numel()

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            # The local sum of every member's whole input ([size * n]), reduced across processes.
            acc = torch.cat([t.reshape(-1) for t in slot.payloads[0][1]])
            for s in range(self.size):
                others = [slot.payloads[o][1][s].reshape(-1) for o in range(1, len(slot.payloads))]
                accumulate_(acc[s * n : (s + 1) * n], others, inner, self.size)
            gloo_ops.all_reduce(self._pg("lane0", wait), [acc], inner, wait)
            if op is ReduceOp.AVG:
                accumulate_(acc, [], op, self.size)
            slot.result = acc

        self._step(slot, li, seq, call, 1, work)
        copy_into(output, slot.result[member * n : (member + 1) * n].view(output.shape))

    def barrier(
        self, member: int, seq: int, call: Call, timeout: float | None = None, async_op: bool = False
    ) -> None:
        li, slot = self._arrive(member, seq, call, None, timeout)
        self._step(slot, li, seq, call, 0, timeout=timeout)  # the control message is the barrier

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
        """Through this group's messages (buffered: a ring never waits for itself), tagged with the call's
        number in a space user tags do not reach."""
        tag, dst, src = PERMUTE_TAG - seq, src_dst[member], src_dst.index(member)
        for t in inputs:
            self.send(member, dst, tag, t)
        for out in outputs:
            _, message = self.recv_message(member, src, tag)
            out.copy_(message)

    # point to point ---------------------------------------------------------------------------------------------
    def exchange(
        self, member: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        exchange_by_messages(self, member, sends, recvs)

    def connect(self, member: int, seq: int, call: Call, pairs: frozenset[tuple[int, int]]) -> None:
        """Nothing to connect: messages are buffered."""

    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor, async_op: bool = False) -> None:
        if dst in self.local_index:
            self.mailboxes.put(member, dst, tag, tensor.detach().clone(memory_format=torch.contiguous_format))
        else:
            process = self.procs[self.proc_index[dst]]
            self._processes.router.send(process, self.key, member, dst, tag, tensor)

    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]:
        return self.mailboxes.take(member, src, tag, timeout)

    def has_message(self, member: int, src: int | None, tag: int) -> bool:
        return self.mailboxes.has_message(member, src, tag)

    def close(self, failed: bool) -> None:
        """Nothing to let go of: the group's state is Python objects (the launch's, dropped with it)."""
