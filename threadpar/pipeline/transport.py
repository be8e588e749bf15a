"""A stage's messages to the other stages on the PP group's own communicator, in the schedule's order.

On a stream-ordered group (nccl) the executor's links send and receive through this transport instead of the
group's buffered send/recv: each message is an ncclSend/ncclRecv on the PP group's communicator
(ProcessGroup.exchange), so a pipeline holds no communicator of its own per pair of stages, makes no copy of
what it sends, and never announces a message through host memory. What that takes (comm/nccl/exchange.py):

- Order. A communicator's launches run one after another and a send completes only with its receive, so the
  stage launches its messages in the order `message_order.launch_orders` proves cannot deadlock. The
  executor hands messages over in its own order (a send once produced, a receive when posted, a consumer's
  wait); the transport launches them in the proven one: a receive is launched as soon as every earlier
  message is (pulled forward: its buffer is new), a send once produced, and whatever is ready at once goes
  in one NCCL group.
- Shapes. A receive names its shape. The first step of each kind (train, eval) learns them: every message
  travels with a fixed-size header before it, which the receiver reads on the host (one host wait per
  message, in that step only); from the second step on, a receive is posted at once from the shapes
  learned, and a sender whose message differs from its first step's raises ConfigError (its receiver posted
  the old shape: NCCL would corrupt or hang).
- Connections. The pairs of stages the plan sends between are connected when the pipeline is built
  (`connect`, a collective every stage runs), so no launch waits for a peer inside NCCL.
- Messages that do not come: whether a gradient goes back is known when the forward runs (an activation that
  carries none, a stage that owes none); the executor says so (`skip`), and the order passes over them.

Captured in a CUDA graph (cuda_graphs/step.py) after its first step, a step's messages are its launches of
known shapes: the graph holds them, with nothing to announce or read.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.pipeline.message_order import Message
from threadpar.pipeline.p2p import describe_tag

# The dtypes a header can name (the comm layer's), by code.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
HEADER = 16  # int64 entries: dtype code, number of dims, the dims (so at most 14 of them), padding

Key = tuple[bool, int, int]  # (sent by this stage, the other stage, tag)
Shape = tuple[tuple[int, ...], torch.dtype]


@dataclass(eq=False)
class _Step:
    """One step's messages on this stage."""

    order: tuple[Message, ...]
    book: dict[Key, Shape]  # the shapes of the first step of this kind
    learning: bool  # this is that first step: headers travel and are read
    index: int = 0  # the next message of `order` to launch
    position: dict[Key, int] = field(default_factory=dict)
    produced: dict[Key, torch.Tensor] = field(default_factory=dict)  # sends handed over, not launched yet
    wanted: set[Key] = field(default_factory=set)  # receives posted, maybe not launched yet
    skipped: set[Key] = field(default_factory=set)  # messages that do not come this step
    received: dict[Key, tuple[torch.Tensor, Any]] = field(default_factory=dict)  # launched: (buffer, Work)


class PostedReceive:
    """A receive handed to the transport: `wait()` returns its tensor (the caller's stream ordered after it)."""

    __slots__ = ("_key", "_transport")

    def __init__(self, transport: Transport, key: Key) -> None:
        self._transport, self._key = transport, key

    def wait(self) -> torch.Tensor:
        return self._transport._take(self._key)


class Transport:
    """This stage's end of the pipeline's messages on the PP group's communicator (module docstring)."""

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.stage = group.rank()
        self.device = device
        # The rank thread hands messages over, and so may its backward on autograd's device thread (the rank
        # thread waits in backward meanwhile): one at a time.
        self._lock = threading.Lock()
        self._books: dict[str, dict[Key, Shape]] = {}  # per kind of step: the shapes its first step learned
        self._step: _Step | None = None

    # the pipeline's life ----------------------------------------------------------------------------------------
    def connect(self, orders: tuple[tuple[Message, ...], ...]) -> None:
        """Connect, on the group's communicator, every pair of stages that `orders` (every stage's) has send a
        message, in its direction: a collective every stage calls when its pipeline is built."""
        ranks = self.group.ranks
        pairs = {(ranks[s], ranks[m.peer]) for s, order in enumerate(orders) for m in order if m.send}
        self.group.connect(sorted(pairs))

    def start(self, kind: str, order: tuple[Message, ...]) -> None:
        """A step of `kind` ("train", "eval") begins; `order`: this stage's launch order for it."""
        book = self._books.get(kind)
        step = _Step(order, {} if book is None else book, learning=book is None)
        step.position = {(m.send, m.peer, m.tag): i for i, m in enumerate(order)}
        with self._lock:
            self._step = step
        self._kind = kind

    def finish(self) -> None:
        """The step's actions have all run: every message of the order was launched (or did not come)."""
        with self._lock:
            step = self._current()
            self._pump(step, len(step.order) - 1)
            if step.index < len(step.order) or step.received:
                left = (
                    step.order[step.index]
                    if step.index < len(step.order)
                    else Message(*next(iter(step.received)))
                )
                raise ConfigError(
                    f"pipeline stage {self.stage}: the step ended before its message {left} was handed over or "
                    "taken (the schedule and the executor disagree)"
                )
            if step.learning:
                self._books[self._kind] = step.book
            self._step = None

    # what a Link calls (pipeline/p2p.py's Channel) --------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        key = (True, self.group.group_rank(dst), tag)
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        shape = (tuple(data.shape), data.dtype)
        with self._lock:
            step = self._current()
            if step.learning:
                step.book[key] = shape
            elif step.book.get(key) != shape:
                first = step.book.get(key)
                raise ConfigError(
                    f"pipeline stage {self.stage} sends {describe_tag(tag)} as {_describe(shape)}, but as "
                    f"{'nothing' if first is None else _describe(first)} at the first step, whose shapes its "
                    "receiver posts now (NCCL needs the receive's shape): keep every microbatch's shapes the "
                    "same from step to step, or build a new PipelineParallel for new ones"
                )
            step.produced[key] = data
            self._pump(step, self._position(step, key))

    def post_recv(self, src: int, tag: int = 0) -> PostedReceive:
        key = (False, self.group.group_rank(src), tag)
        with self._lock:
            step = self._current()
            step.wanted.add(key)
            self._pump(step, self._position(step, key))
        return PostedReceive(self, key)

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        return self.post_recv(src, tag).wait()

    def skip(self, peer: int, tag: int, send: bool) -> None:
        """Message `tag` to (`send`) or from global rank `peer` does not come this step."""
        with self._lock:
            self._current().skipped.add((send, self.group.group_rank(peer), tag))

    # launching --------------------------------------------------------------------------------------------------
    def _current(self) -> _Step:
        if self._step is None:
            raise ConfigError(
                f"pipeline stage {self.stage}: a message outside a step (start() was not called)"
            )
        return self._step

    def _position(self, step: _Step, key: Key) -> int:
        position = step.position.get(key)
        if position is None:
            send, peer, tag = key
            raise ConfigError(
                f"pipeline stage {self.stage}: message {describe_tag(tag)} {'to' if send else 'from'} stage {peer} "
                "is not in this step's plan"
            )
        return position

    def _pump(self, step: _Step, upto: int) -> None:
        """Launch the order's messages from `step.index`: every one up to `upto` (receives pulled forward),
        then on while the next is ready (a produced send, a posted receive); what is ready together goes in
        one NCCL group. The caller holds `_lock`."""
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[Key, torch.Tensor]] = []
        ranks = self.group.ranks
        while step.index < len(step.order):
            m = step.order[step.index]
            key = (m.send, m.peer, m.tag)
            if key in step.skipped:
                step.index += 1
                continue
            if m.send:
                data = step.produced.pop(key, None)
                if data is None:
                    break
                if step.learning:
                    self._launch(step, sends, recvs)
                    self.group.exchange(sends=[(ranks[m.peer], _header(data)), (ranks[m.peer], data)])
                else:
                    sends.append((ranks[m.peer], data))
            else:
                if key not in step.wanted and step.index > upto:
                    break
                if step.learning:
                    self._launch(step, sends, recvs)
                    shape = step.book[key] = self._read_header(ranks[m.peer])
                    buffer = torch.empty(shape[0], dtype=shape[1], device=self.device)
                    step.received[key] = (buffer, self.group.exchange(recvs=[(ranks[m.peer], buffer)]))
                else:
                    shape = step.book[key]
                    recvs.append((key, torch.empty(shape[0], dtype=shape[1], device=self.device)))
            step.index += 1
        self._launch(step, sends, recvs)

    def _launch(
        self, step: _Step, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[Key, torch.Tensor]]
    ) -> None:
        """One exchange of what is gathered (then cleared); the receives are then `step.received`."""
        if not sends and not recvs:
            return
        ranks = self.group.ranks
        work = self.group.exchange(sends=list(sends), recvs=[(ranks[key[1]], buf) for key, buf in recvs])
        step.received.update((key, (buf, work)) for key, buf in recvs)
        sends.clear()
        recvs.clear()

    def _read_header(self, src: int) -> Shape:
        """The first step: a message's header, read on the host (its receive waits for the sender)."""
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        self.group.exchange(recvs=[(src, header)]).wait()
        code, ndim, *dims = header.tolist()
        return tuple(dims[:ndim]), DTYPES[code]

    def _take(self, key: Key) -> torch.Tensor:
        with self._lock:
            step = self._current()
            if key not in step.received:
                self._pump(step, self._position(step, key))
            launched = step.received.pop(key, None)
            if launched is None:
                left = step.order[step.index]
                raise ConfigError(
                    f"pipeline stage {self.stage}: {Message(key[0], key[1], key[2])} is consumed before {left}, "
                    "which the launch order puts first, was handed over (the schedule and the executor disagree)"
                )
        buffer, work = launched
        work.wait()
        return buffer


def _header(data: torch.Tensor) -> torch.Tensor:
    """What the first step sends before a message: its dtype code, number of dims and dims (int64)."""
    if data.dim() > HEADER - 2:
        raise ConfigError(
            f"a pipeline message has {data.dim()} dimensions; at most {HEADER - 2} travel between stages "
            "(reshape it)"
        )
    values = [_CODE[data.dtype], data.dim(), *data.shape]
    return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.int64, device=data.device)


def _describe(shape: Shape) -> str:
    dims, dtype = shape
    return f"{str(dtype).removeprefix('torch.')}{list(dims)} ({math.prod(dims)} elements)"
