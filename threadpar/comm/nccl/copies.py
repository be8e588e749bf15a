"""The nccl backend's operations that torch.cuda.nccl lacks, built from copies between the members' devices.

Inside one process no NCCL point-to-point is needed: a device-to-device copy (over NVLink or PCIe) moves
the data, issued on the comm streams and ordered by events like the collectives. torch runs a copy across
devices on the source device's current stream and fences it both ways with the destination device's
current stream; the CudaApi's `copy_` makes those the two members' comm streams.

- scatter, gather, all_to_all: the leader issues every copy of the collective (posted as usual);
- send: the sender copies into a new buffer on the receiver's device and posts (buffer, done event) to
  the receiver's mailbox, without waiting for anybody (buffered, as on the threads backend);
- recv: the receiver's current stream waits for the done event before it reads the buffer.
"""

from __future__ import annotations

import torch

from threadpar.comm.common.rendezvous import Call
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import ConfigError


class NcclCopyCollectives:
    """Mixed into NcclGroup, whose members it uses: _post, _stream, _on, _check_devices, _cuda, devices,
    ranks, size, name, mailboxes."""

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
            for m, (t, _) in enumerate(payloads):
                self._cuda.copy_(t, sources[m], streams[src], streams[m])

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
            for s, (t, _) in enumerate(payloads):
                self._cuda.copy_(targets[s], t, streams[s], streams[dst])

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
            for m, (outs, _) in enumerate(payloads):
                for s in range(self.size):
                    self._cuda.copy_(outs[s], payloads[s][1][m], streams[s], streams[m])

        return self._post(member, seq, call, (outputs, inputs), launch, nccl=False)

    # point to point ---------------------------------------------------------------------------------------------
    def send(self, member: int, dst: int, tag: int, tensor: torch.Tensor) -> NcclWork:
        """Copy `tensor` into a new buffer on the receiver's device, on the comm streams, and post it.

        The caller's stream must not overwrite `tensor` before the copy has read it: ProcessGroup.send
        waits for the returned Work (on the stream, not the host); isend leaves that to the caller."""
        self._check_devices(member, "send", [tensor])
        cuda = self._cuda
        src_stream, dst_stream = self._stream(member), self._stream(dst)
        ready, done = cuda.event(), cuda.event()
        ready.record(cuda.current_stream(self.devices[member]))
        with cuda.launch_lock:
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
            cuda=cuda,
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
