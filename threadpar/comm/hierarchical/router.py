"""Point-to-point messages between rank threads of different processes, over torch.distributed send/recv.

A message crosses as two gloo messages on one group that spans every process: a fixed-size header (its
group, source and destination members, the user's tag, dtype and shape) and the payload bytes. Each process
runs one receiver thread (the pump) that takes any header, then the payload from that header's sender,
and drops the message into the destination group's mailbox, exactly where a send from a local thread
would have put it. So receives, any-source receives, probes, timeouts and aborts work unchanged, shape and
dtype travel with the message (`recv_tensor`), and a send never waits for the receiver to call recv.

A sender posts header and payload under a lock per destination process, so the pump, which reads a header
from anyone and then the payload from its sender, always pairs them right. At the end of a launch every
process sends each other a goodbye header; a pump stops after hearing from everyone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from threadpar.comm.common.abort import POLL_INTERVAL_S, AbortSignal
from threadpar.comm.common.mailbox import Mailboxes
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.errors import CollectiveTimeoutError, ConfigError, ThreadparError

HEADER_LEN = 32
_FIXED = 9  # kind, sender process, group key, src member, dst member, tag, dtype, ndim, bytes; the shape
MAX_DIMS = HEADER_LEN - _FIXED
KIND_MESSAGE, KIND_GOODBYE = 1, 2
HEADER_TAG, PAYLOAD_TAG = 1, 2
INT64_MAX = (1 << 63) - 1

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
_DTYPE_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}


def encode_header(
    sender: int,
    group_key: int,
    src: int,
    dst: int,
    tag: int,
    dtype: torch.dtype,
    shape: Sequence[int],
    nbytes: int,
) -> torch.Tensor:
    if len(shape) > MAX_DIMS:
        raise ConfigError(
            f"send: a message to another process has at most {MAX_DIMS} dimensions, got {len(shape)}; "
            "reshape it before sending"
        )
    if not -INT64_MAX <= tag <= INT64_MAX:
        raise ConfigError(f"send: tag {tag} does not fit in 64 bits")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    fields = [KIND_MESSAGE, sender, group_key, src, dst, tag, _DTYPE_CODE[dtype], len(shape), nbytes, *shape]
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[int, int, int, int, int, int, torch.dtype, list[int], int]:
    """(kind, sender process, group key, src member, dst member, tag, dtype, shape, payload bytes)"""
    kind, sender, key, src, dst, tag, code, ndim, nbytes, *rest = header.tolist()
    return kind, sender, key, src, dst, tag, DTYPES[code], rest[:ndim], nbytes


class MessageRouter:
    def __init__(
        self,
        pg: Any,
        process_rank: int,
        process_count: int,
        device_of: Callable[[int], torch.device],
        on_lost: Callable[[str], None],
    ) -> None:
        self._pg = pg
        self.rank, self.count = process_rank, process_count
        self._device_of = device_of
        self._on_lost = on_lost
        self._lock = threading.Lock()
        # group key -> (where its messages go, its ranks, whether a message moves to its receiver's device)
        self._targets: dict[int, tuple[Mailboxes, tuple[int, ...], bool]] = {}
        self._pending: dict[int, list[tuple[int, int, int, torch.Tensor]]] = {}
        self._send_locks = [threading.Lock() for _ in range(process_count)]
        self._closing = False
        self._done = threading.Event()
        self._pump = threading.Thread(
            target=self._receive_all, name=f"threadpar-pump-p{process_rank}", daemon=True
        )

    def start(self) -> None:
        self._pump.start()

    def register(
        self, group_key: int, mailboxes: Mailboxes, ranks: Sequence[int], *, on_device: bool = True
    ) -> None:
        """Deliver the messages of group `group_key` into `mailboxes` (including those already here), moved
        to the receiver's device (`on_device`), or left in host memory (the nccl backend's announcements)."""
        with self._lock:
            self._targets[group_key] = (mailboxes, tuple(ranks), on_device)
            waiting = self._pending.pop(group_key, [])
        for src, dst, tag, message in waiting:
            mailboxes.put(src, dst, tag, self._place(message, ranks[dst]) if on_device else message)

    # sending ----------------------------------------------------------------------------------------------------
    def send(self, process: int, group_key: int, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        """Post a message for member `dst` (in `process`); returns once it has been handed over."""
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        payload = byte_view(data)
        header = encode_header(self.rank, group_key, src, dst, tag, data.dtype, data.shape, payload.numel())
        with self._send_locks[process]:
            works = [self._pg.send([header], process, HEADER_TAG)]
            if payload.numel():
                works.append(self._pg.send([payload], process, PAYLOAD_TAG))
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            raise ThreadparError(
                f"send to process {process} failed (did that process die?): {error}"
            ) from error

    def close(self, abort: AbortSignal | None, timeout: float) -> None:
        """Say goodbye to every other process, then wait until each has said goodbye to us."""
        self._closing = True
        goodbye = torch.zeros(HEADER_LEN, dtype=torch.int64)
        goodbye[0] = KIND_GOODBYE
        for process in range(self.count):
            if process != self.rank:
                with self._send_locks[process]:
                    work = self._pg.send([goodbye], process, HEADER_TAG)
                try:
                    work.wait()
                except RuntimeError as error:
                    raise ThreadparError(
                        f"process {process} is gone at the end of the launch: {error}"
                    ) from error
        deadline = time.monotonic() + timeout
        while not self._done.wait(POLL_INTERVAL_S):
            if abort is not None:
                abort.raise_if_set()
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"process {self.rank} finished, but not every other process did within {timeout:g} s"
                )
        # Its teardown is all that is left; it drops the pump's hold on this router and its gloo group,
        # whose destructor must not run on it during interpreter exit (launch.py: _join_left).
        self._pump.join()

    # receiving --------------------------------------------------------------------------------------------------
    def _receive_all(self) -> None:
        goodbyes = 0
        try:
            while goodbyes < self.count - 1:
                header = torch.empty(HEADER_LEN, dtype=torch.int64)
                self._pg.recv_anysource([header], HEADER_TAG).wait()
                kind, sender, key, src, dst, tag, dtype, shape, nbytes = decode_header(header)
                if kind == KIND_GOODBYE:
                    goodbyes += 1
                    continue
                payload = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    self._pg.recv([payload], sender, PAYLOAD_TAG).wait()
                self._deliver(key, src, dst, tag, payload.view(dtype).reshape(shape))
        except Exception as error:
            self._on_lost(f"process {self.rank} lost the connection to another process: {error}")
        finally:
            self._done.set()

    def _deliver(self, key: int, src: int, dst: int, tag: int, message: torch.Tensor) -> None:
        with self._lock:
            target = self._targets.get(key)
            if target is None:  # the group does not exist here yet: keep the message for it
                self._pending.setdefault(key, []).append((src, dst, tag, message))
                return
        mailboxes, ranks, on_device = target
        mailboxes.put(src, dst, tag, self._place(message, ranks[dst]) if on_device else message)

    def _place(self, message: torch.Tensor, rank: int) -> torch.Tensor:
        device = self._device_of(rank)
        return message if device.type == "cpu" else message.to(device)
