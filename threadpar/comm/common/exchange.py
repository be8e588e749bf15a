"""ProcessGroup.exchange on a backend whose messages are buffered (threads, hierarchical): sends and receives of
known shapes, matched per pair in issue order, as on nccl (comm/nccl/exchange.py), through the backend's own
mailboxes: a send never waits, so no order of them can deadlock here."""

from __future__ import annotations

from typing import Any

import torch

# The tag of exchange's messages: below any tag a user passes (the message router carries 64-bit tags).
EXCHANGE_TAG = -(1 << 61)


def exchange_by_messages(
    backend: Any,
    member: int,
    sends: list[tuple[int, torch.Tensor]],
    recvs: list[tuple[int, torch.Tensor]],
) -> None:
    """`backend.send` each (dst, tensor), then `backend.recv_message` into each (src, tensor), in order."""
    for dst, tensor in sends:
        backend.send(member, dst, EXCHANGE_TAG, tensor)
    for src, out in recvs:
        _, message = backend.recv_message(member, src, EXCHANGE_TAG)
        out.copy_(message)
