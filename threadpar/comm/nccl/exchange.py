"""Sends and receives of known shapes on a group's own communicator, issued together: what a pipeline's
stages and torch's batched point to point need (ProcessGroup.exchange), at the cost of one NCCL group.

threadpar's plain send/recv (p2p.py) is buffered and tagged, which costs a communicator per direction of a
pair and an announcement through host memory; here nothing is announced and nothing is buffered, as with
torch's batch_isend_irecv on ProcessGroupNCCL (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: coalesced
point to point runs on the group's own communicator, keyed by device, where a lone send/recv gets one per
pair of ranks, getKeySendRecv). What that asks of the caller is NCCL's:

- Matching: each pair's sends and receives match in the order they are issued on either side, without tags
  (nccl.h; user guide usage/p2p.html), with the same count and type: a receive names its shape.
- Order: a communicator's launches run one after another on the device, whatever stream they went to
  (src/enqueue.cc, ncclLaunchPrepare waits for the communicator's deviceStream, ncclLaunchFinish advances
  it), so every rank must issue its exchanges, and the group's collectives, in an order all of them agree on
  (a pipeline schedule's: pipeline/message_order.py proves its orders). Within one call, sends and receives
  are one NCCL group and progress together (two ranks that exchange with each other in one call cannot wait
  for each other).
- Connections: NCCL connects a pair on its first use, blocking inside the group end until the peer does the
  same (src/group.cc, ncclP2PPreconnectFunc -> ncclTransportP2pSetup). An exchange never does that while
  holding the device: its pairs must have been connected by a collective first (a `permute` over them, whose
  first use meets the members and connects on a connector: group.py `_issue`), else it is refused with how
  to fix it.

The operation runs on the member's comm stream: after the work enqueued on the caller's stream when it
sends (its tensors' producers), and without waiting for it when it only receives, so that a receive posted
ahead overlaps the caller's work; its Work's `wait()` orders the caller's stream after it. In a CUDA graph
capture the comm stream joins the capture (at the send's event, or at the capture's start for a receive) and
is joined back at the capture's end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.common import graph_capture
from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import CudaApi, NcclApi, NcclRuntime
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.common.work import LazyText
from threadpar.comm.nccl.comm import NcclComm
from threadpar.comm.nccl.library import nccl_group
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import ConfigError


class NcclExchange:
    """Mixed into NcclGroup, whose members it uses; declared here for the type checker."""

    name: str
    ranks: tuple[int, ...]
    devices: tuple[torch.device, ...]
    _cuda: CudaApi
    _nccl: NcclApi
    _runtime: NcclRuntime
    _abort: AbortSignal
    _timeout: float
    _lock: threading.Lock
    _comms: list[NcclComm | None]
    _streams: list[Any]
    _connected: list[set[tuple[int, int]]]
    _check_devices: Callable[[int, str, Sequence[torch.Tensor]], None]

    def exchange(
        self,
        member: int,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
    ) -> NcclWork:
        """ncclSend of each (dst, tensor) and ncclRecv into each (src, tensor) in one NCCL group on the member's
        communicator (dst, src: members; tensors contiguous); its Work (module docstring). A hot path: a
        pipeline makes one per message."""
        comm, connected = self._comms[member], self._connected[member]
        if (
            comm is None
            or any((member, d) not in connected for d, _ in sends)
            or any((s, member) not in connected for s, _ in recvs)
        ):
            self._refuse_unconnected(member, sends, recvs)
        assert comm is not None  # (refused otherwise)
        device = self.devices[member]
        for _, t in (*sends, *recvs):
            if t.device != device:
                self._check_devices(member, "exchange", [t])  # (raises, naming the fix)
        cuda = self._cuda
        current = cuda.current_stream(device)
        stream = self._streams[member] or self._exchange_stream(member)
        capturing = graph_capture.capturing()
        if sends:  # the sent tensors' producers come first
            ready = cuda.event()
            ready.record(current)
            stream.wait_event(ready)
        elif capturing:  # a receive joins the capture at its start (graph_capture.Script.begin)
            script = graph_capture.capture_script()
            assert script is not None  # (capturing)
            if script.begin is None:
                script.begin = cuda.event()
                script.begin.record(current)
            stream.wait_event(script.begin)
        sent = [(d, byte_view(t)) for d, t in sends]
        received = [(s, byte_view(t)) for s, t in recvs]
        nccl = self._nccl

        def issue(h: Any) -> None:
            with nccl_group(nccl):
                for d, data in sent:
                    nccl.send(data, d, h, stream)
                for s, data in received:
                    nccl.recv(data, s, h, stream)

        comm.launch(issue, stream)
        done = cuda.event()
        done.record(stream)
        for _, t in sends:
            cuda.record_stream(t, stream)
        for _, t in recvs:
            cuda.record_stream(t, stream)
        if capturing:
            graph_capture.at_end(lambda: cuda.current_stream(device).wait_event(done))
        return NcclWork(
            LazyText("exchange on group '{}' (rank {}: {})", self.name, self.ranks[member], _Peers(self, sends, recvs)),
            cuda=cuda, device=device, abort=self._abort, timeout=self._timeout, done=done, comm=comm,
        )  # fmt: skip

    def _refuse_unconnected(
        self, member: int, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        pairs = {(member, d) for d, _ in sends} | {(s, member) for s, _ in recvs}
        missing = (
            sorted(pairs - self._connected[member]) if self._comms[member] is not None else sorted(pairs)
        )
        described = ", ".join(f"rank {self.ranks[a]} -> rank {self.ranks[b]}" for a, b in missing)
        raise ConfigError(
            f"exchange on group '{self.name}' (rank {self.ranks[member]}): point to point between {described} "
            "is not connected on the group's communicator yet; NCCL connects a pair at its first use, waiting "
            "for the peer inside the call, so connect them first with a collective every member calls: "
            "group.connect(pairs) (PipelineParallel does it when it is built; permute connects its own pairs)"
        )

    def _exchange_stream(self, member: int) -> Any:
        """The member's comm stream (the one its asynchronous collectives use: the communicator runs them in
        issue order anyway); one no other live group holds (resources.CommStreams)."""
        stream = self._streams[member]
        if stream is None:
            with self._lock:
                if self._streams[member] is None:
                    self._streams[member] = self._runtime.streams.acquire(self._cuda, self.devices[member])
                stream = self._streams[member]
        return stream


class _Peers:
    """What an exchange's Work says of its peers, formatted only if shown."""

    __slots__ = ("_group", "_recvs", "_sends")

    def __init__(self, group: NcclExchange, sends: list, recvs: list) -> None:
        self._group, self._sends, self._recvs = group, sends, recvs

    def __str__(self) -> str:
        ranks = self._group.ranks
        return f"sends to {[ranks[d] for d, _ in self._sends]}, receives from {[ranks[s] for s, _ in self._recvs]}"
