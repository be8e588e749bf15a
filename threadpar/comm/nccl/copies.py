"""The nccl backend's operations within one process that are copies between the members' devices.

Inside one process no NCCL point-to-point is needed (ncclSend/ncclRecv would hold the sender until the
receiver posts, unlike torch's buffered semantics on threads): a device-to-device copy (over NVLink or PCIe) moves
the data, issued on the comm streams and ordered by events like the collectives. torch runs a copy across
devices on the source device's current stream and fences it both ways with the destination device's
current stream; the CudaApi's `copy_` makes those a copy lane of the source's device (so that copies to
different destinations run at the same time, see `_copies`) and the destination's comm stream.

- scatter, gather, all_to_all: the leader issues every copy of the collective (posted as usual);
- send: the sender copies into a new buffer on the receiver's device and posts (buffer, done event) to
  the receiver's mailbox, without waiting for anybody (buffered, as on the threads backend);
- recv: the receiver's current stream waits for the done event before it reads the buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.cuda_seam import CudaApi, NcclRuntime
from threadpar.comm.common.mailbox import Mailboxes
from threadpar.comm.common.rendezvous import Call
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import ConfigError


class NcclCopyCollectives:
    """Mixed into NcclGroup, whose members it uses: _post, _stream, _on, _check_devices, _cuda, devices,
    local, ranks, size, name, mailboxes."""

    # Declared for the type checker; NcclGroup sets or defines them.
    name: str
    ranks: tuple[int, ...]
    size: int
    devices: tuple[torch.device, ...]
    local: tuple[int, ...]  # the members whose threads run in this process
    mailboxes: Mailboxes
    _cuda: CudaApi
    _runtime: NcclRuntime
    _abort: AbortSignal
    _timeout: float
    _post: Callable[..., NcclWork]
    _stream: Callable[[int], Any]
    _on: Callable[[Any], contextlib.AbstractContextManager[None]]
    _check_devices: Callable[[int, str, Sequence[torch.Tensor]], None]

    def scatter(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
    ) -> NcclWork:
        def launch(payloads, streams) -> None:
            sources = payloads[src][1]
            self._copies([(t, sources[m], src, m) for m, (t, _) in enumerate(payloads)], streams)

        return self._post(member, seq, call, (tensor, chunks), launch, nccl=False)

    def gather(
        self,
        member: int,
        seq: int,
        call: Call,
        tensor: torch.Tensor,
        outputs: list[torch.Tensor] | None,
        dst: int,
    ) -> NcclWork:
        def launch(payloads, streams) -> None:
            targets = payloads[dst][1]
            self._copies([(targets[s], t, s, dst) for s, (t, _) in enumerate(payloads)], streams)

        return self._post(member, seq, call, (tensor, outputs), launch, nccl=False)

    def all_to_all(
        self, member: int, seq: int, call: Call, outputs: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> NcclWork:
        """outputs[s] on member m receives inputs[m] of member s."""

        def launch(payloads, streams) -> None:
            for m, (outs, _) in enumerate(payloads):
                for s in range(self.size):
                    sent = payloads[s][1][m]
                    if outs[s].shape != sent.shape:
                        raise ConfigError(
                            f"all_to_all on group '{self.name}': rank {self.ranks[m]} expects "
                            f"{list(outs[s].shape)} from rank {self.ranks[s]}, which sends {list(sent.shape)}; "
                            "output_tensor_list[i] must have the shape of what rank i puts at this rank's index"
                        )
            pairs = [
                (outs[s], payloads[s][1][m], s, m)
                for m, (outs, _) in enumerate(payloads)
                for s in range(self.size)
            ]
            self._copies(pairs, streams)

        return self._post(member, seq, call, (outputs, inputs), launch, nccl=False)

    def _copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor, int, int]], streams) -> None:
        """dst <- src for every (dst, src, s, m): from member s to member m (`streams`: their comm streams).

        torch runs a copy across devices on the source device's current stream and fences it both ways with
        the destination's (aten/src/ATen/native/cuda/Copy.cu): issued on the comm streams, every copy would
        wait for the ones before it (P^2 copies one after another in an all_to_all). So a copy from s to m
        runs on lane m of s's device (a stream of its own) that first waits for s's comm stream; copies from
        one member to different destinations then run at the same time, those into one destination still
        one after another (its comm stream fences each: its links are the bottleneck anyway). s's comm
        stream waits for its lanes at the end, so the op's done event and the caching allocator (tensors are
        recorded on the comm streams) cover the copies."""
        cuda = self._cuda
        start: dict[int, Any] = {}  # member -> event on its comm stream before any copy
        lanes: dict[tuple[int, int], Any] = {}  # (source, destination) -> the lane its copies run on
        for s in sorted({s for _, _, s, m in pairs if s != m}):  # before any copy fences a comm stream
            start[s] = cuda.event()
            start[s].record(streams[s])
        for dst, src, s, m in pairs:
            if s == m:  # on one device: torch copies on its current stream, no fence
                cuda.copy_(dst, src, streams[s], streams[m])
                continue
            lane = lanes.get((s, m))
            if lane is None:
                lane = lanes[s, m] = self._runtime.streams.lane(cuda, self.devices[self.local[s]], m)
                lane.wait_event(start[s])
            cuda.copy_(dst, src, lane, streams[m])
        for (s, _), lane in lanes.items():
            done = cuda.event()
            done.record(lane)
            streams[s].wait_event(done)

    # point to point ---------------------------------------------------------------------------------------------
    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor) -> NcclWork | None:
        """Copy `tensor` into a new buffer on the receiver's device, on the comm streams, and post it.

        The caller's stream must not overwrite `tensor` before the copy has read it: ProcessGroup.send
        waits for the returned Work (on the stream, not the host); isend leaves that to the caller."""
        self._check_devices(member, "send", [tensor])
        cuda = self._cuda
        src_stream, dst_stream = self._stream(member), self._stream(dst)
        ready, done = cuda.event(), cuda.event()
        ready.record(cuda.current_stream(self.devices[member]))
        with self._runtime.launch_lock:
            src_stream.wait_event(ready)
            # Allocated while the receiver's comm stream is current there: the buffer belongs to that stream.
            with self._on(dst_stream):
                message = torch.empty_like(
                    tensor, device=self.devices[dst], memory_format=torch.contiguous_format
                )
            cuda.copy_(message, tensor, src_stream, dst_stream)
            done.record(src_stream)
            cuda.record_stream(tensor, src_stream)
        self.mailboxes.put(member, dst, tag, (message, done))
        return NcclWork(
            f"send to rank {self.ranks[dst]} (tag {tag}, group '{self.name}')",
            runtime=self._runtime,
            device=self.devices[member],
            abort=self._abort,
            timeout=self._timeout,
            done=done,
        )

    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]:
        """Take a message; the caller's current stream waits for its copy before it reads the buffer.
        (A message from another process comes without an event: it was copied to this device already.)"""
        got, (message, done) = self.mailboxes.take(member, src, tag, timeout)
        if done is not None:
            stream = self._cuda.current_stream(self.devices[member])
            stream.wait_event(done)
            self._cuda.record_stream(message, stream)
        return got, message

    def has_message(self, member: int, src: int | None, tag: int) -> bool:
        return self.mailboxes.has_message(member, src, tag)
