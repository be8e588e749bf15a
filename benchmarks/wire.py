"""A model of a link whose transfers take time and start only once the receive is posted, over a group of
threads: what makes posting receives ahead (PipelineParallel(prefetch=True)) pay off.

threadpar's backends buffer a send at once, so a receive posted early changes nothing for them. On a
rendezvous transport the data moves only when both sides have posted (NCCL: ncclSend "is blocking for the
GPU" until the peer's matching ncclRecv runs, per its documentation of ncclSend/ncclRecv), and then takes
the transfer time. `WireChannel` adds exactly that rule to a group: a message sent at time s and received
through a receive posted at time p can be taken at max(s, p) + latency. Used by the pipeline benchmark and
the tests to show the wait for messages falling when receives are posted ahead.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from threadpar.pipeline.p2p import Channel


class WireChannel:
    """`channel` (a ProcessGroup) with a transfer time of `latency` seconds that starts when both the send
    and the receive are posted. One per rank; `clock` is shared by the ranks of a pipeline."""

    def __init__(self, channel: Channel, rank: int, latency: float, clock: WireClock) -> None:
        self.channel, self.rank, self.latency, self.clock = channel, rank, latency, clock
        self.exposed = 0.0  # seconds this rank waited for transfers (after the message was sent)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.clock.sent(self.rank, dst, tag)  # before the message can be taken
        self.channel.send(tensor, dst, tag)

    def post_recv(self, src: int, tag: int) -> _Posted:
        return _Posted(self, src, tag, time.perf_counter())

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        return self.post_recv(src, tag).wait()


class _Posted:
    def __init__(self, wire: WireChannel, src: int, tag: int, posted_at: float) -> None:
        self.wire, self.src, self.tag, self.posted_at = wire, src, tag, posted_at

    def wait(self) -> torch.Tensor:
        wire = self.wire
        message = wire.channel.recv_tensor(self.src, self.tag)
        sent_at = wire.clock.take(self.src, wire.rank, self.tag)
        delay = max(sent_at, self.posted_at) + wire.latency - time.perf_counter()
        if delay > 0:
            wire.exposed += delay  # only this rank's thread waits on its own wire
            time.sleep(delay)
        return message


class WireClock:
    """When each message was sent, shared by the ranks (threads) of one pipeline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[tuple[int, int, int], deque[float]] = {}

    def sent(self, src: int, dst: int, tag: int) -> None:
        with self._lock:
            self._sent.setdefault((src, dst, tag), deque()).append(time.perf_counter())

    def take(self, src: int, dst: int, tag: int) -> float:
        with self._lock:
            return self._sent[(src, dst, tag)].popleft()


def install_wire(pipe, latency: float, clock: WireClock) -> WireChannel:
    """Put one `WireChannel` under the links of a PipelineParallel to its neighbouring ranks (a rank's
    messages to itself stay local)."""
    wire = WireChannel(pipe.group, pipe.group.global_rank, latency, clock)
    for peer, link in pipe._links.items():
        if peer != pipe.stage:
            link.channel = wire
    return wire
