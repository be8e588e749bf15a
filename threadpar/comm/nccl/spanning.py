"""The `nccl` backend for a group whose member threads live in several processes (torchrun).

It is `NcclGroup` (group.py) over the members in THIS process: each issues its own NCCL calls, and the NCCL
ranks are the members' indices in the whole group, so the processes' calls are the parts of one NCCL
operation, at NCCL's own bytes (all_reduce, broadcast and reduce from any root, all_gather, reduce_scatter;
scatter, gather and all_to_all as grouped ncclSend/ncclRecv; point to point on pair communicators). Nothing
goes through host memory but what NCCL cannot carry: unique ids (the launch's store), and the
announcements of point-to-point messages (tag, shape, dtype: the message router, comm/hierarchical/router.py).

What differs from one process:
- Meetings (creating and connecting communicators) also check through the store that every process came
  with the same call (process_check.py), before anyone enters a blocking NCCL call; a process that does not
  come is named.
- Unique ids reach the other processes through the store: member 0's process writes the group's, the lower
  member's process a pair's.
- With LaunchConfig.check_collectives, every collective's call is also compared across processes (a store
  round trip, by the member that completes the local check): a debugging aid, like TORCH_DISTRIBUTED_DEBUG.
  Without it a process that skips a later collective is named by the watchdog's timeout in the processes
  that issued it (its ledger knows their local members issued it; the device knows it never ran).
- Nothing is pooled: every communicator is destroyed when the launch ends (every process must agree to
  reuse one).

The group's key, the same in every process, tells apart two groups of the same ranks (new_group with a
timeout of its own is another communicator): every store key and the router's messages use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.backend import BackendSite
from threadpar.comm.common.rendezvous import Call, Slot
from threadpar.comm.nccl.bootstrap import shared_unique_id, unique_id_key
from threadpar.comm.nccl.comm import NcclComm
from threadpar.comm.nccl.group import NcclGroup
from threadpar.comm.nccl.p2p import Header
from threadpar.comm.nccl.process_check import ProcessCheck
from threadpar.errors import CollectiveMismatchError

# dtypes of announced messages, by their code in an announcement (threadpar's supported dtypes)
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}


def encode(header: Header) -> torch.Tensor:
    """An announcement as the router carries it: int64 [index, dtype code, *shape] (the tag travels apart)."""
    return torch.tensor([header.place, _CODE[header.dtype], *header.shape], dtype=torch.int64)


def decode(tag: int, message: torch.Tensor) -> Header:
    place, code, *shape = message.tolist()
    return Header(tag, tuple(shape), DTYPES[code], place)


class _Announcements:
    """Where the router drops this group's announcements from other processes (host memory)."""

    def __init__(self, group: NcclSpanningGroup) -> None:
        self._group = group

    def put(self, src: int, dst: int, tag: int, message: torch.Tensor) -> None:
        self._group._inboxes[dst].announce(src, decode(tag, message))


class NcclSpanningGroup(NcclGroup):
    def __init__(self, name: str, ranks: Sequence[int], world: BackendSite, key: int) -> None:
        processes = world.processes
        local = [m for m, r in enumerate(ranks) if r in world.local_ranks]
        super().__init__(name, ranks, world, local, key)
        self.key = key
        self._processes = processes
        proc_of = [processes.process_of(r) for r in self.ranks]
        self.procs = tuple(sorted(set(proc_of)))
        self._process_of_member = proc_of
        self._check = ProcessCheck(
            name,
            self.ranks,
            self.procs,
            [[r for r, p in zip(self.ranks, proc_of) if p == q] for q in self.procs],
            self.procs.index(processes.rank),
            processes,
            f"{key:x}",
            world.abort,
            world.timeout,
        )
        self._check_every_call = world.check_collectives
        self._store: Any = None  # a store client, made on first use
        processes.router.register(key, _Announcements(self), self.ranks, on_device=False)

    def _store_client(self) -> Any:
        if self._store is None:
            self._store = self._processes.store_client()  # (one client per group; its calls are thread-safe)
        return self._store

    # meetings and ids across processes --------------------------------------------------------------------------
    def _meet(self, member: int, seq: int, call: Call, leader: Callable[[Slot], bool] | None = None) -> Slot:
        """The local members meet; the last of them checks that every process came with the same call."""

        def agree(slot: Slot) -> bool:
            slot.error = self._check.agree(seq, call, "meeting")
            return False

        return self.meetings.arrive(self.local_index[member], seq, call, None, leader=agree, final=True)

    def _unique_id(self, member: int, slot: Slot) -> bytes:
        return shared_unique_id(
            self._store_client(),
            unique_id_key(f"{self.key:x}"),
            member == 0,
            self._nccl.get_unique_id,
            self._abort,
            self._timeout,
            lambda: (
                f"rank {self.ranks[member]} of group '{self.name}' waited {self._timeout:g} s for the process of "
                f"rank {self.ranks[0]} (member 0) to publish the group's NCCL unique id"
            ),
        )

    def _enter(self, member: int, seq: int, call: Call) -> None:
        complete = self.ledger.enter(self.local_index[member], seq, call)
        if complete and self._check_every_call:
            mismatch = self._check.agree(seq, call)
            if mismatch is not None:
                raise CollectiveMismatchError(mismatch)

    def _device_wait_explained(self) -> bool:
        # A member's call is on its device before the processes' check of it ends (only the member that
        # completes the local check asks the other processes): a process that skipped the call is named by
        # the check, not reported as a device that waits.
        return self._check.explains_device_waits()

    def _pair_ids(self, member: int, peer: int) -> tuple[bytes, bytes]:
        if self._process_of_member[peer] == self._processes.rank:
            return super()._pair_ids(member, peer)
        lo, hi = sorted((member, peer))
        ids = shared_unique_id(
            self._store_client(),
            f"nccl/{self.key:x}/pair/{lo}-{hi}",
            member == lo,
            lambda: self._nccl.get_unique_id() + self._nccl.get_unique_id(),
            self._abort,
            self._timeout,
            lambda: self._describe_pair_timeout(member, peer),
        )
        half = len(ids) // 2
        return ids[:half], ids[half:]

    def _announce(self, member: int, dst: int, header: Header) -> None:
        process = self._process_of_member[dst]
        if process == self._processes.rank:
            super()._announce(member, dst, header)
        else:
            self._processes.router.send(process, self.key, member, dst, header.tag, encode(header))

    def _keep(self, comms: list[NcclComm]) -> list[NcclComm]:
        return comms  # nothing pooled: every communicator is destroyed
