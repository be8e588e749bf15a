"""The hierarchical backend's collectives that move bytes: broadcast, all_gather, gather, scatter, all_to_all.

Mixed into HierarchicalGroup (group.py), whose steps they use: the local rendezvous (`_arrive`), the
check between processes with its inline payload (`_step`), and the group's gloo groups (`_pg`). Data moves
as bytes, so every dtype works; small data rides in the control message (one round trip in all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from threadpar.comm.common.call_check import INLINE_BYTES
from threadpar.comm.common.fastcopy import copy_into
from threadpar.comm.common.rendezvous import Call, Slot
from threadpar.comm.common.tensor_bytes import byte_view, split_range
from threadpar.comm.hierarchical import gloo_ops


def typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bytes `raw` seen as a tensor with the dtype and shape of `like`."""
    if raw.numel() == 0:  # (an empty slice's storage offset need not be aligned)
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).view(like.shape)


def concat_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors' bytes, one after the other, as one flat uint8 tensor in host memory."""
    parts = [byte_view(t.contiguous()).cpu() for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class HierarchicalByteCollectives:
    """Uses HierarchicalGroup's _arrive, _step, _pg, _lanes_for, local_index, proc_index, members_by_proc,
    max_local, local, procs, size and name."""

    # Declared for the type checker; HierarchicalGroup sets or defines them.
    name: str
    size: int
    procs: tuple[int, ...]
    proc_index: list[int]  # member -> index of its process in `procs`
    members_by_proc: list[list[int]]
    max_local: int
    local: list[int]
    local_index: dict[int, int]
    _arrive: Callable[[int, int, Call, Any], tuple[int, Slot]]
    _step: Callable[..., None]
    _pg: Callable[[str, gloo_ops.Wait], Any]
    _lanes_for: Callable[[int], int]

    def _by_member(self, rows: torch.Tensor, like: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(member, its tensor) from every process's local inputs packed in member order, one row each."""
        n = like.nbytes
        for q, members in enumerate(self.members_by_proc):
            for i, m in enumerate(members):
                yield m, typed(rows[q, i * n : (i + 1) * n], like)

    def _exchange(self, slot: Slot, li: int, seq: int, call: Call, input_of: Callable) -> torch.Tensor:
        """Every member's input (`input_of(payload)`), gathered from all processes: a [processes, bytes]
        tensor, each row a process's local inputs in member order."""
        like = input_of(slot.payloads[0])
        width = self.max_local * like.nbytes
        packed = lambda: concat_bytes([input_of(p) for p in slot.payloads])  # noqa: E731

        def inline(rows: torch.Tensor) -> None:
            slot.result = rows[:, :width]

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            mine = torch.zeros(width, dtype=torch.uint8)
            data = packed()
            mine[: data.numel()] = data
            slot.result = gloo_ops.all_gather(self._pg("lane0", wait), mine, wait)

        if width <= INLINE_BYTES:
            self._step(slot, li, seq, call, 1, payload=packed, inline=inline)
        else:
            self._step(slot, li, seq, call, 1, work)
        return slot.result

    # copies -----------------------------------------------------------------------------------------------------
    def broadcast(
        self, member: int, seq: int, call: Call, tensor: torch.Tensor, src: int, async_op: bool = False
    ) -> None:
        li, slot = self._arrive(member, seq, call, tensor)
        src_li = self.local_index.get(src)
        flats = [t.view(-1) for t in slot.payloads]
        holder = li if src_li is None else src_li  # the source's process sends from its tensor

        def share(a: int, b: int, value: torch.Tensor, skip: int | None) -> None:
            for o, flat in enumerate(flats):
                if o != skip:
                    copy_into(flat[a:b], value)

        nbytes = tensor.nbytes
        if nbytes <= INLINE_BYTES:
            root = self.proc_index[src]
            inline = lambda rows: share(0, tensor.numel(), rows[root, :nbytes].view(tensor.dtype), src_li)  # noqa: E731
            payload = (lambda: byte_view(flats[src_li].cpu())) if src_li is not None else None
            self._step(slot, li, seq, call, 1, payload=payload, inline=inline)
            return
        lanes = self._lanes_for(nbytes)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            a, b = split_range(tensor.numel(), lanes)[lane]
            gloo_ops.broadcast(self._pg(f"lane{lane}", wait), flats[holder][a:b], self.proc_index[src], wait)
            share(a, b, flats[holder][a:b], holder)

        self._step(slot, li, seq, call, lanes, work)

    def all_gather(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
    ) -> None:
        li, slot = self._arrive(member, seq, call, (outputs, tensor))
        rows = self._exchange(slot, li, seq, call, lambda p: p[1])
        for m, value in self._by_member(rows, tensor):
            copy_into(outputs[m], value)

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
        li, slot = self._arrive(member, seq, call, (tensor, outputs))
        rows = self._exchange(slot, li, seq, call, lambda p: p[0])
        if member == dst:
            assert outputs is not None  # ProcessGroup.gather requires gather_list on dst
            for m, value in self._by_member(rows, tensor):
                copy_into(outputs[m], value)

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
        li, slot = self._arrive(member, seq, call, (tensor, chunks))
        n = tensor.nbytes
        src_li = self.local_index.get(src)

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            # Every process receives all chunks (a broadcast): simple, and scatter is never hot.
            packed = torch.empty(self.size * n, dtype=torch.uint8)
            if src_li is not None:
                packed.copy_(concat_bytes(slot.payloads[src_li][1]))
            gloo_ops.broadcast(self._pg("lane0", wait), packed, self.proc_index[src], wait)
            slot.result = packed

        self._step(slot, li, seq, call, 1, work)
        copy_into(tensor, typed(slot.result[member * n : (member + 1) * n], tensor))

    def all_to_all(
        self,
        member: int,
        seq: int,
        call: Call,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        async_op: bool = False,
    ) -> None:
        """outputs[s] on member m receives inputs[m] of member s. Between processes the bytes go
        sender-major, receiver-minor, both in member order; each side sizes them from its own tensors, and
        the sizes travel with the control message, so that disagreeing sizes raise instead of crashing gloo."""
        li, slot = self._arrive(member, seq, call, (outputs, inputs))
        local = range(len(self.local))
        sends = [[slot.payloads[i][1][s] for i in local for s in members] for members in self.members_by_proc]
        expected = [
            [slot.payloads[i][0][m] for m in members for i in local] for members in self.members_by_proc
        ]
        in_splits = [sum(t.nbytes for t in ts) for ts in sends]
        out_splits = [sum(t.nbytes for t in ts) for ts in expected]
        k = len(self.procs)

        def agree(rows: torch.Tensor) -> None:
            if 16 * k > INLINE_BYTES:
                return  # (more processes than the control message can describe: not checked)
            table = rows[:, : 16 * k].view(torch.int64).view(k, 2, k)  # [process, (sends, expects), peer]
            wrong = [(p, q) for p in range(k) for q in range(k) if table[p, 0, q] != table[q, 1, p]]
            if wrong:
                p, q = wrong[0]
                slot.error = (
                    f"all_to_all on group '{self.name}': process {self.procs[p]} sends {int(table[p, 0, q])} "
                    f"bytes to process {self.procs[q]}, which expects {int(table[q, 1, p])}; "
                    "output_tensor_list[i] must have the shape of what rank i puts at this rank's index"
                )

        def work(wait: gloo_ops.Wait, lane: int) -> None:
            out = torch.empty(sum(out_splits), dtype=torch.uint8)
            data = concat_bytes([t for ts in sends for t in ts])
            gloo_ops.all_to_all(self._pg("lane0", wait), out, data, out_splits, in_splits, wait)
            slot.result = out

        splits = lambda: byte_view(torch.tensor(in_splits + out_splits, dtype=torch.int64))  # noqa: E731
        self._step(slot, li, seq, call, 1, work, payload=splits, agree=agree)
        offset = 0  # (the slot let go of the payloads at its last meeting: `expected` holds them)
        for targets in expected:  # per process, member-major, local-member-minor
            for position, target in enumerate(targets):
                n = target.nbytes
                if position % len(local) == li:
                    copy_into(target, typed(slot.result[offset : offset + n], target))
                offset += n
