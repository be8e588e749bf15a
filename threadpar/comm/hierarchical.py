"""The hierarchical backend: collectives on a group whose member threads live in more than one process.

It has the method interface of `ThreadsGroup`, so `ProcessGroup` (validation, sequence numbers) is shared.
Each collective has three steps:

1. the members in this process meet at a local rendezvous (which checks they agree on the call);
2. leader threads talk to the other processes over gloo (`gloo_ops`); meanwhile one of them all-gathers
   a description of the call from every process on a separate gloo group, so a mismatch between processes
   raises CollectiveMismatchError instead of hanging;
3. the results are shared with the local members, and they meet once more.

Large all-reduces and broadcasts use lanes: with L members in every process, local member j leads lane j,
a 1/L slice of the data with a gloo group of its own, so the lanes reduce and transfer in parallel. An
all-reduce is thus a local reduce-scatter, L parallel cross-process all-reduces, and a local all-gather.
The other collectives (and small ones) have one leader, the member that arrived last at the local
rendezvous (it is running; the others are already waiting), and move bytes (any dtype). Each gloo group belongs to one threadpar
group and one lane and is created on first use, so independent groups never share a torch.distributed
group and never need a common order of calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from threadpar.comm import gloo_ops
from threadpar.comm.abort import AbortSignal
from threadpar.comm.fastcopy import copy_into
from threadpar.comm.mailbox import Mailboxes
from threadpar.comm.reduce_op import ReduceOp, accumulate_
from threadpar.comm.rendezvous import Call, Rendezvous, Slot
from threadpar.comm.router import as_bytes
from threadpar.comm.threads import pieces, split_range
from threadpar.errors import RankAborted

# A lane gets at least this many bytes: below it, one more gloo call costs more than it saves.
LANE_MIN_BYTES = 1 << 20
CONTROL_BYTES = 128  # the call description every process all-gathers: 8 bytes of hash, then text


def group_key(ranks: Sequence[int]) -> int:
    """A stable 63-bit id of a group (its global ranks), the same in every process."""
    digest = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bytes `raw` seen as a tensor with the dtype and shape of `like`."""
    if raw.numel() == 0:  # (an empty slice's storage offset need not be aligned)
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).view(like.shape)


def _control_bytes(text: str) -> torch.Tensor:
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest() + text.encode()[: CONTROL_BYTES - 8]
    out = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


class HierarchicalGroup:
    def __init__(
        self, name: str, ranks: Sequence[int], processes: Any, abort: AbortSignal, timeout: float
    ) -> None:
        self.name = name
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self._processes = processes
        self._abort = abort
        self._timeout = timeout
        proc_of = [processes.process_of(r) for r in self.ranks]
        self.procs = tuple(sorted(set(proc_of)))
        self.proc_index = [self.procs.index(p) for p in proc_of]  # member -> index of its process
        self.members_by_proc = [[m for m in range(self.size) if proc_of[m] == p] for p in self.procs]
        self.local = self.members_by_proc[self.procs.index(processes.rank)]
        self.local_index = {m: i for i, m in enumerate(self.local)}
        self.max_local = max(len(ms) for ms in self.members_by_proc)
        self.lanes = min(len(ms) for ms in self.members_by_proc)
        self.key = group_key(self.ranks)
        self.rendezvous = Rendezvous(name, [self.ranks[m] for m in self.local], abort, timeout)
        self.mailboxes = Mailboxes(name, self.ranks, abort, timeout)
        self._gloo: dict[str, Any] = {}
        processes.router.register(self.key, self.mailboxes, self.ranks)

    # plumbing ---------------------------------------------------------------------------------------------------
    def _pg(self, which: str) -> Any:
        """This group's gloo group `which` ("lane0", "control", ...). Each is used by one member thread
        only, which creates it on first use, meeting its peers in the other processes."""
        pg = self._gloo.get(which)
        if pg is None:
            pg = self._gloo[which] = self._processes.gloo_group(f"{self.key:x}/{which}", self.procs)
        return pg

    def _lanes_for(self, nbytes: int) -> int:
        return max(1, min(self.lanes, nbytes // LANE_MIN_BYTES))

    def _arrive(self, member: int, seq: int, call: Call, payload: Any) -> tuple[int, Slot]:
        li = self.local_index[member]

        def mark_last(slot: Slot) -> bool:  # run by the last member to arrive
            slot.shared[li] = True
            return False

        return li, self.rendezvous.arrive(li, seq, call, payload, leader=mark_last)

    def _step(self, slot: Slot, li: int, seq: int, call: Call, lanes: int, work: Callable) -> None:
        """Run `work(wait, lane)` on the lane leaders: local members 0..lanes-1 when there are several
        lanes, else the member that arrived last (it is running; the others are already waiting). One of
        them (local member 0, or that last arrival) checks that every process made the same call. Then all
        local members meet; an error in any of it is raised on every local member."""
        last = slot.shared.index(True)
        if lanes > 1:
            lane, checks = (li if li < lanes else None), li == 0
        else:
            lane, checks = (0 if lanes == 1 and li == last else None), li == last
        control = None

        def cancelled() -> bool:
            if slot.error is None and control is not None and control[0].is_completed():
                slot.error = self._mismatch(seq, control)
            return slot.error is not None

        def wait(work_: Any, what: str = "the other processes") -> None:
            gloo_ops.wait_work(
                work_,
                abort=self._abort,
                timeout=self._timeout,
                cancelled=cancelled,
                describe=lambda: (
                    f"{call} #{seq} on group '{self.name}' (global ranks {list(self.ranks)}) timed out after "
                    f"{self._timeout:g} s waiting for {what} (processes {list(self.procs)}); a process that "
                    "skips the collective, or is stuck or dead, causes this"
                ),
            )

        try:
            if checks:
                control = self._control_start(seq, call)
            if lane is not None:
                work(wait, lane)
            if control is not None:
                wait(control[0], "the call descriptions of the other processes")
                cancelled()
        except gloo_ops.Cancelled:
            pass
        except RankAborted:
            raise
        except Exception as error:
            if slot.error is None:
                slot.error = error
        if slot.error is not None:  # gloo operations of this group may be left pending: never destroy it
            self._processes.abandon(list(self._gloo.values()))
        self.rendezvous.sync(slot, li, seq, final=True)

    def _control_start(self, seq: int, call: Call) -> tuple[Any, torch.Tensor, torch.Tensor]:
        mine = _control_bytes(f"#{seq} {call}")
        gathered = torch.empty(len(self.procs), CONTROL_BYTES, dtype=torch.uint8)
        work = self._pg("control").allgather([list(gathered.unbind(0))], [mine])
        return work, mine, gathered

    def _mismatch(self, seq: int, control: tuple[Any, torch.Tensor, torch.Tensor]) -> str | None:
        _, mine, gathered = control
        if all(torch.equal(row, mine) for row in gathered):
            return None
        lines = [
            f"collective mismatch on group '{self.name}' (global ranks {list(self.ranks)}) across processes "
            f"at its call #{seq}: members must call the same collectives, with the same dtypes and shapes, "
            "in the same order (the group cannot be used after this)"
        ]
        for p, row in zip(self.procs, gathered):
            text = bytes(row[8:].tolist()).rstrip(b"\0").decode(errors="replace")
            mark = "" if torch.equal(row, mine) else f"   <-- differs from process {self._processes.rank}"
            lines.append(f"  process {p}: {text}{mark}")
        return "\n".join(lines)

    def _by_member(self, gathered: torch.Tensor, like: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(member, its tensor) from an all-gather of every process's local inputs packed in member order."""
        n = _nbytes(like)
        for q, members in enumerate(self.members_by_proc):
            for i, m in enumerate(members):
                yield m, _typed(gathered[q, i * n : (i + 1) * n], like)

    def _exchange(self, slot: Slot, li: int, seq: int, call: Call, input_of: Callable) -> torch.Tensor:
        """All-gather every member's input (`input_of(payload)`): a [processes, bytes] tensor."""

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            inputs = [input_of(p) for p in slot.payloads]
            n = _nbytes(inputs[0])
            packed = torch.empty(self.max_local * n, dtype=torch.uint8)
            for i, t in enumerate(inputs):
                copy_into(packed[i * n : (i + 1) * n], as_bytes(t.contiguous()))
            slot.result = gloo_ops.all_gather(self._pg("lane0"), packed, wait)

        self._step(slot, li, seq, call, 1, work)
        return slot.result

    # reductions -------------------------------------------------------------------------------------------------
    def all_reduce(
        self, member: int, seq: int, call: Call, tensors: list[torch.Tensor], op: ReduceOp
    ) -> None:
        li, slot = self._arrive(member, seq, call, tensors)
        numels = [t.numel() for t in tensors]
        lanes = self._lanes_for(sum(_nbytes(t) for t in tensors))
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op  # divide once, by the whole group's size

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            flat = [[t.view(-1) for t in payload] for payload in slot.payloads]
            others = [o for o in range(len(flat)) if o != li]
            parts = pieces(numels, *split_range(sum(numels), lanes)[lane])
            mine = [flat[li][i][a:b] for i, a, b in parts]
            for (i, a, b), acc in zip(parts, mine):  # this lane's slice of the local sum, in my own tensor
                accumulate_(acc, [flat[o][i][a:b] for o in others], inner, self.size)
            gloo_ops.all_reduce(self._pg(f"lane{lane}"), mine, inner, wait)
            for (i, a, b), acc in zip(parts, mine):
                if op is ReduceOp.AVG:
                    accumulate_(acc, [], op, self.size)
                for o in others:
                    copy_into(flat[o][i][a:b], acc)

        self._step(slot, li, seq, call, lanes, work)

    def reduce(self, member: int, seq: int, call: Call, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        li, slot = self._arrive(member, seq, call, tensor)
        lanes = self._lanes_for(_nbytes(tensor))
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        dst_li = self.local_index.get(dst)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            flats = [t.view(-1) for t in slot.payloads]
            a, b = split_range(tensor.numel(), lanes)[lane]
            acc = flats[li][a:b].clone()  # only dst's tensor may change
            accumulate_(acc, [f[a:b] for o, f in enumerate(flats) if o != li], inner, self.size)
            gloo_ops.all_reduce(self._pg(f"lane{lane}"), [acc], inner, wait)
            if dst_li is not None:
                if op is ReduceOp.AVG:
                    accumulate_(acc, [], op, self.size)
                copy_into(flats[dst_li][a:b], acc)

        self._step(slot, li, seq, call, lanes, work)

    def reduce_scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        output: torch.Tensor,
        inputs: list[torch.Tensor],
        op: ReduceOp,
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
            gloo_ops.all_reduce(self._pg("lane0"), [acc], inner, wait)
            if op is ReduceOp.AVG:
                accumulate_(acc, [], op, self.size)
            slot.result = acc

        self._step(slot, li, seq, call, 1, work)
        copy_into(output, slot.result[member * n : (member + 1) * n].view(output.shape))

    # copies -----------------------------------------------------------------------------------------------------
    def broadcast(self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int) -> None:
        li, slot = self._arrive(member, seq, call, tensor)
        lanes = self._lanes_for(_nbytes(tensor))
        src_li = self.local_index.get(src)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            flats = [t.view(-1) for t in slot.payloads]
            a, b = split_range(tensor.numel(), lanes)[lane]
            holder = li if src_li is None else src_li  # the source's process sends from its tensor
            gloo_ops.broadcast(self._pg(f"lane{lane}"), flats[holder][a:b], self.proc_index[src], wait)
            for o, flat in enumerate(flats):
                if o != holder:
                    copy_into(flat[a:b], flats[holder][a:b])

        self._step(slot, li, seq, call, lanes, work)

    def all_gather(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], tensor: torch.Tensor
    ) -> None:
        li, slot = self._arrive(member, seq, call, (outputs, tensor))
        gathered = self._exchange(slot, li, seq, call, lambda p: p[1])
        for m, value in self._by_member(gathered, tensor):
            copy_into(outputs[m], value)

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
    ) -> None:
        li, slot = self._arrive(member, seq, call, (tensor, outputs))
        gathered = self._exchange(slot, li, seq, call, lambda p: p[0])
        if member == dst:
            for m, value in self._by_member(gathered, tensor):
                copy_into(outputs[m], value)

    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
    ) -> None:
        li, slot = self._arrive(member, seq, call, (tensor, chunks))
        n = _nbytes(tensor)
        src_li = self.local_index.get(src)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            # Every process receives all chunks (a broadcast): simple, and scatter is never hot.
            packed = torch.empty(self.size * n, dtype=torch.uint8)
            if src_li is not None:
                for m, chunk in enumerate(slot.payloads[src_li][1]):
                    copy_into(packed[m * n : (m + 1) * n], as_bytes(chunk.contiguous()))
            gloo_ops.broadcast(self._pg("lane0"), packed, self.proc_index[src], wait)
            slot.result = packed

        self._step(slot, li, seq, call, 1, work)
        copy_into(tensor, _typed(slot.result[member * n : (member + 1) * n], tensor))

    def all_to_all(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> None:
        """outputs[s] on member m receives inputs[m] of member s. Between processes the bytes go
        sender-major, receiver-minor, both in member order; sizes come from each side's own tensors."""
        li, slot = self._arrive(member, seq, call, (outputs, inputs))

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            parts, in_splits, out_splits = [], [], []
            for members in self.members_by_proc:
                sent = [slot.payloads[i][1][s] for i in range(len(self.local)) for s in members]
                parts += [as_bytes(t.contiguous()).cpu() for t in sent]
                in_splits.append(sum(_nbytes(t) for t in sent))
                expected = [slot.payloads[i][0][m] for m in members for i in range(len(self.local))]
                out_splits.append(sum(_nbytes(t) for t in expected))
            data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            out = torch.empty(sum(out_splits), dtype=torch.uint8)
            gloo_ops.all_to_all(self._pg("lane0"), out, data, out_splits, in_splits, wait)
            slot.result = out

        self._step(slot, li, seq, call, 1, work)
        offset = 0
        for members in self.members_by_proc:
            for m in members:
                for i in range(len(self.local)):
                    target = slot.payloads[i][0][m]
                    n = _nbytes(target)
                    if i == li:
                        copy_into(target, _typed(slot.result[offset : offset + n], target))
                    offset += n

    def barrier(self, member: int, seq: int, call: Call) -> None:
        li, slot = self._arrive(member, seq, call, None)
        self._step(slot, li, seq, call, 0, None)  # the call check is the barrier

    # point to point ---------------------------------------------------------------------------------------------
    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
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
