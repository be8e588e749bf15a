"""The first step of every collective between processes: agree on the call, and carry small data along.

Before any data moves between processes, one thread per process all-gathers a fixed-size control message:
a description of the call (its sequence number on the group, operation, dtype, shape and arguments, with a
hash of the whole description) followed by an inline payload. Only when every process described the same
call does data move. gloo aborts the whole process (std::terminate) when the sizes of a collective differ
between processes, so this check is what turns a mismatch into a CollectiveMismatchError on every rank
instead of a crash or a hang. A collective whose data fits in the payload (a loss, a flag, a norm) is
finished from the gathered payloads: one round trip in all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from threadpar.comm.common.mismatch import header, member_lines

CONTROL_BYTES = 4096  # fixed, so that even disagreeing processes exchange messages of one size
HEADER_BYTES = 128  # 8 bytes of hash, then the description's text (truncated)
INLINE_BYTES = CONTROL_BYTES - HEADER_BYTES


def control_message(seq: int, call: object, payload: torch.Tensor | None = None) -> torch.Tensor:
    """The control message of call #seq: header, then `payload` (flat uint8, at most INLINE_BYTES)."""
    text = f"#{seq} {call}".encode()
    header = hashlib.blake2b(text, digest_size=8).digest() + text[: HEADER_BYTES - 8]
    message = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    message[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    if payload is not None and payload.numel():
        message[HEADER_BYTES : HEADER_BYTES + payload.numel()] = payload
    return message


def payloads(rows: torch.Tensor) -> torch.Tensor:
    """[processes, INLINE_BYTES]: the payloads of the gathered control messages."""
    return rows[:, HEADER_BYTES:]


def mismatch(
    name: str, ranks: Sequence[int], procs: Sequence[int], me: int, seq: int, rows: torch.Tensor
) -> str | None:
    """None if every process described the same call, else a message showing each process's call.
    `rows` are the gathered control messages, `me` this process's row."""
    rows_head = rows[:, :HEADER_BYTES]
    if all(torch.equal(h, rows_head[me]) for h in rows_head):
        return None
    members = []
    for p, row in zip(procs, rows_head):
        raw = bytes(row.tolist())
        members.append((f"process {p}", raw, raw[8:].rstrip(b"\0").decode(errors="replace")))
    return "\n".join([header(name, ranks, seq, " across processes"), *member_lines(members)])
