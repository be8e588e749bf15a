"""The `nccl` backend for a group whose member threads live in several processes (torchrun).

It is `NcclGroup` (group.py) over the members in THIS process: they meet at a local rendezvous, and the last
to post launches ONE NCCL group for them (their tensors, comm streams and communicators,
in group order) under the process-wide launch lock, with ready/done events, exactly as in one process. The
NCCL ranks are the members' indices in the whole group, so the processes' grouped calls are the parts of
one NCCL collective. Communicators: on the group's first NCCL collective the local members meet once, the
leader checks that every process came with the same call (process_check.py), then each member thread
joins the group's clique with `join_nccl_group` (member 0 puts the unique id in the launch's store).
They are not pooled across launches (every process would have to agree on reusing them).

NCCL's C API takes every count and root per communicator (library.py), so all_reduce, broadcast and reduce
from any root, all_gather and reduce_scatter are NCCL's own across processes too, at their optimal bytes
(through torch.cuda.nccl, which sizes and indexes by the local lists, reduce, reduce_scatter and all_gather
were all-reduces: 2x the bytes, and a broadcast from a member other than 0 too). The rest:
- scatter, gather, all_to_all, barrier: through host memory and gloo, with the hierarchical backend's code
  (comm/hierarchical/group.py). Each member's current stream is synchronized first (the host waits for the device);
  the op is done when it returns, so async_op=True does not overlap it. Cost: a device-to-host and a
  host-to-device copy of the data plus gloo's TCP transfer, instead of NCCL: fine for scatter/gather,
  slow for a hot all_to_all (MoE expert parallelism across processes: keep EP groups inside a process).
- send/recv: to a member in this process, a device-to-device copy on the comm streams (as in one process);
  to another process, the message router (comm/hierarchical/router.py: a blocking device-to-host copy on the sender's
  current stream, gloo, a host-to-device copy on arrival). Sends stay buffered; any-source receives work.

Checks: the local members' calls are compared at every collective (the rendezvous), the processes' calls
on a group's first NCCL collective and, with LaunchConfig.check_collectives, on every NCCL collective (a
store round trip per call: a debugging aid). Without it a process that skips a later collective is not
named: the others' NCCL kernels wait, and `Work.wait(timeout)` / `synchronize()` time out. The
host-staged ops are always checked (the hierarchical backend's control message).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.backend import BackendSite
from threadpar.comm.common.rendezvous import Call, Slot
from threadpar.comm.hierarchical.group import HierarchicalGroup, group_key
from threadpar.comm.nccl.bootstrap import join_nccl_group
from threadpar.comm.nccl.group import NcclGroup, _tensors
from threadpar.comm.nccl.process_check import ProcessCheck
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import NcclError


class _Inbox:
    """Where the router drops this group's messages from other processes: the group's mailboxes, as
    (tensor, None) (no event: the router's host-to-device copy has finished when it delivers)."""

    def __init__(self, mailboxes: Any) -> None:
        self._mailboxes = mailboxes

    def put(self, src: int, dst: int, tag: int, message: torch.Tensor) -> None:
        self._mailboxes.put(src, dst, tag, (message, None))


class NcclSpanningGroup(NcclGroup):
    def __init__(self, name: str, ranks: Sequence[int], world: BackendSite) -> None:
        processes = world.processes
        local = [m for m, r in enumerate(ranks) if r in world.local_ranks]
        super().__init__(name, ranks, world, local)
        self._processes = processes
        self.key = group_key(self.ranks)
        self._host = HierarchicalGroup(
            name, ranks, processes, world.abort, world.timeout, route_messages=False
        )
        self._check = ProcessCheck(
            name,
            self.ranks,
            self._host.procs,
            [[self.ranks[m] for m in members] for members in self._host.members_by_proc],
            self._host.me,
            processes,
            f"{self.key:x}",
            world.abort,
            world.timeout,
        )
        self._check_every_call = world.check_collectives
        processes.router.register(self.key, _Inbox(self.mailboxes), self.ranks)

    # communicators and checks -----------------------------------------------------------------------------------
    def _communicator(self, member: int, seq: int, call: Call) -> Any:
        """This member's communicator; on first use the local members meet, their leader checks that every
        process came with the same call, then each member joins the clique (blocking until all have)."""
        comm = self._comms[member]
        if comm is not None:
            return comm
        joining = call._replace(extra=(*call.extra, ("creating", "NCCL communicators")))

        def meet(slot: Slot) -> bool:  # run by the last local member to arrive, while the others wait
            slot.error = self._check.agree(seq, joining)
            return False

        self.rendezvous.arrive(self.local_index[member], 0, joining, None, leader=meet, final=True)
        try:
            with self._initialising(member):
                comm = join_nccl_group(
                    self._processes.store_client(),
                    f"{self.key:x}",
                    member,
                    self.size,
                    self._timeout,
                    self._runtime.nccl,
                    self._device_ids[member],
                )
        except RuntimeError as error:
            raise NcclError(
                f"creating the NCCL communicator of rank {self.ranks[member]} in group '{self.name}' "
                f"(global ranks {list(self.ranks)}, across processes {list(self._host.procs)}) failed: {error}"
            ) from error
        self._comms[member] = comm
        return comm

    def _before_launch(self, seq: int, call: Call) -> str | None:
        return self._check.agree(seq, call) if self._check_every_call else None

    # through host memory ----------------------------------------------------------------------------------------
    def _host_staged(
        self, member: int, seq: int, call: Call, payload: Any, run: Callable[[], None], *, sync: bool = True
    ) -> NcclWork:
        """Run a hierarchical-backend op after the host has waited for this member's current stream (`sync`:
        its tensors are final); it has finished when it returns, so its Work is complete."""
        self._check_devices(member, call.op, _tensors(payload))
        if sync:
            self._cuda.current_stream(self.devices[member]).synchronize()
        run()
        return self._work(member, seq, call)

    def scatter(self, member, seq, call, tensor, chunks, src) -> NcclWork:
        run = lambda: self._host.scatter(member, seq, call, tensor, chunks, src)  # noqa: E731
        return self._host_staged(member, seq, call, (tensor, chunks or []), run)

    def gather(self, member, seq, call, tensor, outputs, dst) -> NcclWork:
        run = lambda: self._host.gather(member, seq, call, tensor, outputs, dst)  # noqa: E731
        return self._host_staged(member, seq, call, (tensor, outputs or []), run)

    def all_to_all(self, member, seq, call, outputs, inputs) -> NcclWork:
        run = lambda: self._host.all_to_all(member, seq, call, outputs, inputs)  # noqa: E731
        return self._host_staged(member, seq, call, (outputs, inputs), run)

    def barrier(self, member: int, seq: int, call: Call, timeout: float | None = None) -> NcclWork:
        """A host barrier of every member, in every process (it orders no device work, as in one process)."""
        run = lambda: self._host.barrier(member, seq, call, timeout)  # noqa: E731
        return self._host_staged(member, seq, call, (), run, sync=False)

    # point to point ---------------------------------------------------------------------------------------------
    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor) -> NcclWork | None:
        if dst in self.local_index:
            return super().send(member, dst, tag, tensor)  # a device-to-device copy
        self._check_devices(member, "send", [tensor])
        process = self._host.procs[self._host.proc_index[dst]]
        self._processes.router.send(process, self.key, member, dst, tag, tensor)
        return None  # handed over: `tensor` may be reused at once
