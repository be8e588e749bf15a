"""Point to point on the nccl backend: ncclSend/ncclRecv on communicators of their own, buffered and tagged.

torch.distributed's point to point (and threadpar's, DESIGN.md rule 8) is tagged and buffered: a send returns
at once and its tensor may be reused; a receive names a source and a tag, in any order against other tags.
NCCL's is neither: ncclSend "is blocking for the GPU" until the peer's matching ncclRecv runs, and sends and
receives between two ranks match per communicator in issue order, without tags (nccl.h; user guide,
usage/p2p.html). Two ranks that send to each other before they receive would deadlock on one communicator,
and two messages received in another order than sent would swap. So:

- Each ordered pair of members (a sends to b) has a two-rank communicator and a stream on each side of its
  own: a's sends to b never wait behind its receives from b, nor behind anything else. (One communicator for
  both directions would not do: NCCL runs a communicator's launches one after another, src/enqueue.cc
  ncclLaunchPrepare, and a send completes only with its receive, so two members that each send before they
  receive would wait for each other for ever. Where both sides know the order and the shapes, the group's own
  communicator carries the messages instead: exchange.py, which pipelines and ring attention use.)
- A send announces the message (tag, shape, dtype, its place on the pair) to the receiver through host
  memory (the receiver's Inbox; across processes the message router) and issues ncclSend on the pair's
  stream after the caller's earlier work; it never waits for the receiver. A synchronous one then makes the
  caller's stream wait for its ncclSend, so the tensor may be overwritten in stream order with no copy (as
  torch's send); only while the pair's communicators are still being made is it a snapshot (a device copy:
  its ncclSend is issued later, by the maker). isend makes no copy and no wait: wait on its Work before
  overwriting the tensor, as torch's. Every launch on the pair's nonblocking communicators goes on in a
  thread of NCCL's (2.23+), which comm.py waits for without the device's lock: the cost of this path.
- A receive waits on the host until the source has announced a message with its tag (one process per GPU
  knows its shapes beforehand; a receive of a tagged message of unknown shape cannot), then issues ncclRecv
  for every message that source announced up to it, in their send order, into new buffers on the pair's
  stream; the ones of other tags wait there for their receive. The caller's stream waits for its message.
- A pair's communicators are made when it is first used, either way, in the background: each member's side
  has a maker thread that meets the peer's (the meeting is the only wait), creates the side's two
  communicators and connects them with a grouped one-byte exchange each way (NCCL makes point-to-point
  connections on first use, blocking until the peer connects), then issues the sends queued meanwhile, in
  order. A send never waits for it: its snapshot and its place in the caller's stream are taken at once, and
  its ncclSend is issued when the pair exists (an isend's Work waits for that first). A receive needs the pair
  to issue its ncclRecv, and waits for it (a receive waits for its message anyway). torch's ProcessGroupNCCL
  makes a communicator per pair on first use too (pointToPoint), but its first send waits for the peer.
- In a CUDA graph capture (cuda_graphs/step.py) nothing is announced: the sender captures at another time
  than the receiver, and replays run no Python. A graphed step's last eager call (its rehearsal) noted the
  headers each member sent and took (comm/common/graph_capture.py, Script); at capture a send must be the
  rehearsal's next one to that peer (else GraphCaptureError) and a receive posts the rehearsal's headers up
  to its tag, as an eager receive posts the announced ones. NCCL matches a pair's calls in issue order, and
  every replay issues the captured ones in that order on both sides. The pair's streams join the capture
  (a send's stream waits for the caller's stream at the send; the receiving stream for an event recorded at
  the capture's start) and are joined back at its end. The rehearsal's eager sends may still be outstanding
  when the first replay's captured ones launch on the same communicators: NCCL supports outstanding
  operations that are "any combination of graph-captured or non-captured" (user guide, "Using NCCL with
  CUDA Graphs"; NCCL_GRAPH_MIXING_SUPPORT, on by default).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from threadpar.comm.common import graph_capture
from threadpar.comm.common.abort import AbortSignal, wait_until
from threadpar.comm.common.cuda_seam import CudaApi, NcclApi, NcclRuntime
from threadpar.comm.common.tensor_bytes import byte_view
from threadpar.comm.nccl.comm import NcclComm
from threadpar.comm.nccl.library import NONBLOCKING_VERSION, nccl_group
from threadpar.comm.nccl.work import NcclWork
from threadpar.errors import CollectiveTimeoutError, GraphCaptureError, NcclError


class Header(NamedTuple):
    """A message announced to its receiver: what to receive, and its place among the pair's messages."""

    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    place: int  # the message's number among those its sender sent this receiver


class _Received(NamedTuple):
    buffer: torch.Tensor
    done: Any  # an event on the pair's receiving stream, after its ncclRecv


class Pair(NamedTuple):
    """One member's side of its pair with a peer: its communicator and stream for each direction."""

    send: NcclComm  # NCCL rank 0 sends to rank 1
    recv: NcclComm  # NCCL rank 1 receives from rank 0
    send_stream: Any
    recv_stream: Any


class Inbox:
    """The messages announced to one receiving member, and those received but not yet taken."""

    def __init__(self, abort: AbortSignal) -> None:
        self.cond = threading.Condition(threading.Lock())
        abort.register(self.cond)
        self.announced: dict[int, deque[Header]] = {}  # source -> headers not yet received, in send order
        self.received: dict[tuple[int, int], deque[_Received]] = {}  # (source, tag) -> received, in order
        # One receiving thread per source at a time from taking headers to issuing their ncclRecv, so that
        # a source's messages are received in the order they were sent (the rank thread and autograd's
        # engine thread may both receive).
        self.posting: dict[int, threading.Lock] = {}

    def announce(self, src: int, header: Header) -> None:
        with self.cond:
            self.announced.setdefault(src, deque()).append(header)
            self.cond.notify_all()

    def ready(self, src: int | None, tag: int) -> tuple[bool, int] | None:
        """(True, source): received and waiting; (False, source): announced, to receive; None: neither.
        The caller holds `cond`."""
        for (s, t), waiting in self.received.items():
            if t == tag and waiting and (src is None or s == src):
                return True, s
        sources = self.announced if src is None else {src: self.announced.get(src, deque())}
        for s, headers in sources.items():
            if any(h.tag == tag for h in headers):
                return False, s
        return None

    def take_until(self, src: int, tag: int) -> list[Header]:
        """The headers of `src` up to and including its first with `tag` (none if another thread took it)."""
        headers = self.announced.get(src, deque())
        if not any(h.tag == tag for h in headers):
            return []
        taken = []
        while True:
            header = headers.popleft()
            taken.append(header)
            if header.tag == tag:
                return taken


class _PairMeeting:
    """Two members of this process meeting to make their pair's communicators (the second makes the ids)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.arrived: set[int] = set()
        self.ids: tuple[bytes, bytes] | None = None  # (lo -> hi, hi -> lo)


class _Send(NamedTuple):
    """A send issued before its pair's communicators existed: the maker issues it once they do."""

    payload: torch.Tensor
    ready: Any  # recorded on the sender's stream at the send: the ncclSend waits for it
    done: Any  # recorded after the ncclSend (an isend's Work waits on it)
    issued: threading.Event  # set once the ncclSend is issued (or the pair failed: `_Side.error`)


class _Side:
    """One member's side of its pair with a peer: its streams at once, its communicators from its maker."""

    def __init__(self, send_stream: Any, recv_stream: Any) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.send_stream, self.recv_stream = send_stream, recv_stream
        self.pair: Pair | None = None  # once made
        self.error: BaseException | None = None  # the maker failed (a timeout, a stop)
        self.pending: list[_Send] = []  # sends waiting for the pair, in order
        self.maker: threading.Thread | None = None


class _IssueGate:
    """What an isend's Work waits for before its done event means anything: the ncclSend was issued."""

    __slots__ = ("_issued", "_side")

    def __init__(self, side: _Side, issued: threading.Event) -> None:
        self._side, self._issued = side, issued

    def wait(self, timeout: float, abort: AbortSignal) -> None:
        deadline = time.monotonic() + timeout
        while not self._issued.wait(0.05):
            abort.raise_if_set()
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"an isend waited {timeout:g} s for its pair's NCCL communicators (its receiver never came)"
                )
        if self._side.error is not None:
            raise self._side.error

    def is_set(self) -> bool:
        return self._issued.is_set()


class NcclPointToPoint:
    """Mixed into NcclGroup, whose members it uses; declared here for the type checker."""

    name: str
    ranks: tuple[int, ...]
    size: int
    devices: tuple[torch.device, ...]
    local: tuple[int, ...]
    _device_ids: tuple[int, ...]
    _cuda: CudaApi
    _nccl: NcclApi
    _runtime: NcclRuntime
    _abort: AbortSignal
    _timeout: float
    _lock: threading.Lock
    _check_devices: Callable[[int, str, Sequence[torch.Tensor]], None]

    def _init_p2p(self, world: Any, key: int | None) -> None:
        self._inboxes = {m: Inbox(world.abort) for m in self.local}
        self._sides: dict[tuple[int, int], _Side] = {}  # (member, peer) -> the member's side; under _lock
        self._sent: dict[tuple[int, int], int] = {}  # (member, peer) -> messages sent; under the link's lock
        self._links: dict[tuple[int, int], threading.Lock] = {}  # (member, peer) -> one sender at a time
        self._meetings: dict[tuple[int, int], _PairMeeting] = {}  # (lo, hi) -> their meeting (under _lock)

    # sending ----------------------------------------------------------------------------------------------------
    def send(
        self, member: int, dst: int, tag: int, tensor: torch.Tensor, async_op: bool = False
    ) -> NcclWork | None:
        """Returns at once. Synchronous: the caller's stream then waits for the ncclSend, so the tensor may be
        overwritten in stream order, with no copy (as torch's send: its Work waited on the current stream); a
        snapshot only while the pair's communicators are still being made (the ncclSend comes later, from the
        maker). `async_op` (isend): no copy and no wait; wait on its Work before overwriting the tensor."""
        self._check_devices(member, "send", [tensor])
        device = self.devices[member]
        current = self._cuda.current_stream(device)
        side = self._sides.get((member, dst))  # (a dict read of a write-once entry: DESIGN.md rule 10)
        in_order = async_op or (side is not None and side.pair is not None)
        if in_order:
            data = tensor if tensor.is_contiguous() else tensor.contiguous()
        else:
            data = tensor.clone(memory_format=torch.contiguous_format)
        ready, done = self._cuda.event(), self._cuda.event()
        ready.record(current)
        queued = _Send(byte_view(data), ready, done, threading.Event())
        script = graph_capture.capture_script()
        if script is not None:
            return self._send_captured(script, member, dst, tag, data, queued, async_op)
        with self._link(member, dst):  # this pair's messages are announced and issued in one order
            place = self._sent.get((member, dst), 0)
            self._sent[member, dst] = place + 1
            header = Header(tag, tuple(data.shape), data.dtype, place)
            self._announce(member, dst, header)
            rehearsal = graph_capture.rehearsal_script()
            if rehearsal is not None:
                rehearsal.sent.setdefault((self, member, dst), []).append(header)
            side = self._side(member, dst)
            with side.cond:
                if side.error is not None:
                    raise side.error
                pair = side.pair
                if pair is None:
                    side.pending.append(queued)  # its maker issues it once the pair exists
            if pair is not None:
                self._issue_send(pair, queued)
        self._cuda.record_stream(data, side.send_stream)
        if not async_op:
            if in_order:  # (issued above: the pair existed, and a pair is never unmade)
                current.wait_event(done)
            return None
        return NcclWork(
            f"isend to rank {self.ranks[dst]} (tag {tag}, group '{self.name}')",
            cuda=self._cuda,
            device=device,
            abort=self._abort,
            timeout=self._timeout,
            done=done,
            comm=None if pair is None else pair.send,
            gate=None if pair is not None else _IssueGate(side, queued.issued),
        )

    def _send_captured(
        self,
        script: graph_capture.Script,
        member: int,
        dst: int,
        tag: int,
        data: torch.Tensor,
        queued: _Send,
        async_op: bool,
    ) -> NcclWork | None:
        """A send in a capture: its ncclSend goes into the graph, unannounced (the receiver's capture follows
        its rehearsal's script instead: `_recv_captured`), so it must be the message the rehearsal sent."""
        expected = script.to_send.get((self, member, dst))
        sending = f"{tuple(data.shape)} {data.dtype} with tag {tag}"
        if not expected or (expected[0].tag, expected[0].shape, expected[0].dtype) != (
            tag,
            tuple(data.shape),
            data.dtype,
        ):
            rehearsed = (
                f"{expected[0].shape} {expected[0].dtype} with tag {expected[0].tag}"
                if expected
                else "nothing more"
            )
            raise GraphCaptureError(
                f"rank {self.ranks[member]} sends {sending} to rank {self.ranks[dst]} in the captured step, where its "
                f"last eager call (the rehearsal) sent {rehearsed} at this point: the receiver's graph holds the "
                "rehearsal's receives, so a graphed step must send the same messages in the same order at every call"
            )
        expected.pop(0)
        pair = self._captured_pair(member, dst)
        device, done = self.devices[member], queued.done
        self._join_at_end(pair.send_stream, device)
        self._issue_send(pair, queued)  # (the pair's stream waits for `ready`: it joins the capture there)
        self._cuda.record_stream(data, pair.send_stream)
        if not async_op:  # (no snapshot: the caller's stream waits for the send, as eagerly)
            self._cuda.current_stream(device).wait_event(done)
            return None
        return NcclWork(
            f"isend to rank {self.ranks[dst]} (tag {tag}, group '{self.name}')",
            cuda=self._cuda, device=device, abort=self._abort, timeout=self._timeout, done=done, comm=pair.send,
        )  # fmt: skip

    def _join_at_end(self, stream: Any, device: torch.device) -> None:
        """`stream` forks from the capture next: the caller's stream waits for all of its captured work before the
        capture ends. Registered before the fork, so that a failure between the fork and the op's own event (a
        launch aborted by a peer's error) still ends the capture joined, not in CUDA's unjoined-fork error 904
        (which would replace the step's error and leave the allocator's capture underway)."""

        def join() -> None:
            joined = self._cuda.event()
            joined.record(stream)
            self._cuda.current_stream(device).wait_event(joined)

        graph_capture.at_end(join)

    def _captured_pair(self, member: int, peer: int) -> Pair:
        """The pair's communicators in a capture: made since the warm-up (the first message between two members
        makes them, a meeting of both hosts that a capture cannot hold). Their maker may still be finishing
        (the peer's warm-up may lag): wait for it, so that the eager sends it issues are not captured."""
        if self._sides.get((member, peer)) is None:  # (a dict read of a write-once entry: DESIGN.md rule 10)
            raise GraphCaptureError(
                f"point to point between rank {self.ranks[member]} and rank {self.ranks[peer]} starts in the "
                "captured step: their NCCL communicators are made at their first message, a meeting of both hosts "
                "that a capture cannot hold; exchange a message in the eager warm-up calls first"
            )
        return self._ready_pair(member, peer)

    def _issue_send(self, pair: Pair, send: _Send) -> None:
        stream, payload, nccl = pair.send_stream, send.payload, self._nccl
        stream.wait_event(send.ready)
        pair.send.launch(lambda h: nccl.send(payload, 1, h, stream), stream)
        send.done.record(stream)
        send.issued.set()

    def _link(self, member: int, peer: int) -> threading.Lock:
        lock = self._links.get((member, peer))
        if lock is None:
            with self._lock:
                lock = self._links.setdefault((member, peer), threading.Lock())
        return lock

    def _announce(self, member: int, dst: int, header: Header) -> None:
        """Tell `dst` what is coming (spanning.py sends it to another process)."""
        self._inboxes[dst].announce(member, header)

    # receiving --------------------------------------------------------------------------------------------------
    def recv_message(
        self, member: int, src: int | None, tag: int, timeout: float | None = None
    ) -> tuple[int, torch.Tensor]:
        """The next message from `src` (any source: None) with `tag`; the caller's stream waits for it."""
        script = graph_capture.capture_script()
        if script is not None:
            return self._recv_captured(script, member, src, tag)
        inbox = self._inboxes[member]
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            with inbox.cond:
                wait_until(
                    inbox.cond,
                    lambda: inbox.ready(src, tag) is not None,
                    abort=self._abort,
                    deadline=deadline,
                    describe_timeout=lambda: self._describe_recv_timeout(member, src, tag, timeout),
                )
                received, source = inbox.ready(src, tag)  # type: ignore[misc]  # (not None: waited for)
                if received:
                    buffer, done = inbox.received[source, tag].popleft()
                    break
                posting = inbox.posting.setdefault(source, threading.Lock())
            with posting:
                with inbox.cond:
                    headers = inbox.take_until(source, tag)
                rehearsal = graph_capture.rehearsal_script()
                if rehearsal is not None:
                    rehearsal.received.setdefault((self, member, source), []).extend(headers)
                posted = [self._post_recv(member, source, h) for h in headers]
                with inbox.cond:
                    for header, message in zip(headers, posted):
                        inbox.received.setdefault((source, header.tag), deque()).append(message)
        stream = self._cuda.current_stream(self.devices[member])
        stream.wait_event(done)
        self._cuda.record_stream(buffer, stream)
        return source, buffer

    def _recv_captured(
        self, script: graph_capture.Script, member: int, src: int | None, tag: int
    ) -> tuple[int, torch.Tensor]:
        """A receive in a capture: nothing is announced (the sender's capture runs at another time, and its
        replays announce nothing), so its ncclRecv calls follow the rehearsal's script: every message `src`
        sent this member up to the first with `tag`, in send order, as an eager receive posts them."""
        if src is None:
            raise GraphCaptureError(
                f"a receive from any source on rank {self.ranks[member]} (tag {tag}) inside a step being captured "
                "as a CUDA graph: its ncclRecv needs the source at capture; name the source (src=...)"
            )
        waiting = script.posted.setdefault((self, member, src, tag), [])
        if not waiting:
            rehearsed = script.to_receive.get((self, member, src), [])
            upto = next((i for i, h in enumerate(rehearsed) if h.tag == tag), None)
            if upto is None:
                raise GraphCaptureError(
                    f"rank {self.ranks[member]} receives tag {tag} from rank {self.ranks[src]} in the captured step, "
                    "a message its last eager call (the rehearsal) did not receive there: a capture learns a "
                    "message's shape from the rehearsal, so a graphed step must receive the same messages in the "
                    "same order at every call"
                )
            headers, rehearsed[: upto + 1] = rehearsed[: upto + 1], []
            pair = self._captured_pair(member, src)
            device = self.devices[member]
            if script.begin is None:  # (a capture without a start event: fork here)
                script.begin = self._cuda.event()
                script.begin.record(self._cuda.current_stream(device))
            self._join_at_end(pair.recv_stream, device)
            pair.recv_stream.wait_event(script.begin)  # (joins the capture: graph_capture.Script.begin)
            for header in headers:
                received = self._post_recv(member, src, header)
                script.posted.setdefault((self, member, src, header.tag), []).append(received)
        buffer, done = waiting.pop(0)
        stream = self._cuda.current_stream(self.devices[member])
        stream.wait_event(done)
        self._cuda.record_stream(buffer, stream)
        return src, buffer

    def _post_recv(self, member: int, src: int, header: Header) -> _Received:
        pair = self._ready_pair(member, src)
        stream = pair.recv_stream
        with self._cuda.on_streams(stream):  # the buffer belongs to the pair's stream
            buffer = torch.empty(header.shape, dtype=header.dtype, device=self.devices[member])
        data, nccl = byte_view(buffer), self._nccl
        pair.recv.launch(lambda h: nccl.recv(data, 0, h, stream), stream)
        done = self._cuda.event()
        done.record(stream)
        return _Received(buffer, done)

    def has_message(self, member: int, src: int | None, tag: int) -> bool:
        inbox = self._inboxes[member]
        with inbox.cond:
            return inbox.ready(src, tag) is not None

    def _describe_recv_timeout(self, member: int, src: int | None, tag: int, timeout: float) -> str:
        inbox = self._inboxes[member]
        source = "any rank" if src is None else f"rank {self.ranks[src]}"
        announced = sorted((self.ranks[s], h.tag) for s, hs in inbox.announced.items() for h in hs)
        return (
            f"recv on rank {self.ranks[member]} from {source} (tag {tag}, group '{self.name}') timed out after "
            f"{timeout:g} s: no matching message was sent (messages announced from (rank, tag): "
            f"{announced or 'none'}). Check that the sender calls send() with this rank as dst and the same tag."
        )

    # the pair's communicators -----------------------------------------------------------------------------------
    def _side(self, member: int, peer: int) -> _Side:
        """The member's side of its pair with `peer` (its maker started on first use). On the member's
        thread: its streams are taken from the member's device here."""
        side = self._sides.get((member, peer))  # (a dict read of a write-once entry: DESIGN.md rule 10)
        if side is not None:
            return side
        version = tuple(self._nccl.version()[:2])
        if version < NONBLOCKING_VERSION:
            raise NcclError(
                f"point to point on the nccl backend needs NCCL >= 2.14 (its pairs' communicators are nonblocking, "
                f"so that no thread holds a device while it waits for a peer); this NCCL is {version}: use a newer "
                "torch (2.4+ ships NCCL 2.20+), or backend='threads'"
            )
        with self._lock:
            side = self._sides.get((member, peer))
            if side is None:
                streams = self._runtime.streams
                device = self.devices[member]
                side = self._sides[member, peer] = _Side(
                    streams.acquire(self._cuda, device), streams.acquire(self._cuda, device)
                )
                with self._cuda.on_streams(side.send_stream):
                    ping = torch.empty(1, dtype=torch.uint8, device=device)
                with self._cuda.on_streams(side.recv_stream):
                    pong = torch.empty(1, dtype=torch.uint8, device=device)
                side.maker = threading.Thread(
                    target=self._make_side,
                    args=(member, peer, side, ping, pong),
                    name=f"threadpar-nccl-pair ({self.ranks[member]} with {self.ranks[peer]})",
                    daemon=True,
                )
                side.maker.start()
        return side

    def _ready_pair(self, member: int, peer: int) -> Pair:
        """The pair's communicators, once made (a receive waits for them; bounded, ended by a stop)."""
        side = self._side(member, peer)
        deadline = time.monotonic() + self._timeout
        with side.cond:
            wait_until(
                side.cond,
                lambda: side.pair is not None or side.error is not None,
                abort=self._abort,
                deadline=deadline,
                describe_timeout=lambda: self._describe_pair_timeout(member, peer),
            )
            if side.error is not None:
                raise side.error
            assert side.pair is not None  # (waited for)
            return side.pair

    def _make_side(self, member: int, peer: int, side: _Side, ping: torch.Tensor, pong: torch.Tensor) -> None:
        """The maker: meet the peer, create this side's two communicators and connect them, then issue the
        sends that waited, in order. Only the meeting waits; the NCCL calls after it find the peer there."""
        try:
            ids = self._pair_ids(member, peer)
            pair = self._create_pair(member, peer, ids, side, ping, pong)
            with side.cond:
                for send in side.pending:
                    self._issue_send(pair, send)
                side.pending.clear()
                side.pair = pair
                side.cond.notify_all()
        except BaseException as error:
            with side.cond:
                side.error = error
                for send in side.pending:
                    send.issued.set()  # (its Work then raises the error)
                side.cond.notify_all()

    def _pair_ids(self, member: int, peer: int) -> tuple[bytes, bytes]:
        """The unique ids of the pair's two communicators, (lo -> hi, hi -> lo), once both have come
        (spanning.py: through the store when the peer is in another process)."""
        lo, hi = sorted((member, peer))
        with self._lock:
            meeting = self._meetings.get((lo, hi))
            if meeting is None:
                meeting = self._meetings[lo, hi] = _PairMeeting()
                self._abort.register(meeting.cond)
        with meeting.cond:
            meeting.arrived.add(member)
            if len(meeting.arrived) == 2 and meeting.ids is None:
                meeting.ids = (self._nccl.get_unique_id(), self._nccl.get_unique_id())
                meeting.cond.notify_all()
            wait_until(
                meeting.cond,
                lambda: meeting.ids is not None,
                abort=self._abort,
                deadline=time.monotonic() + self._timeout,
                describe_timeout=lambda: self._describe_pair_timeout(member, peer),
            )
            return meeting.ids  # type: ignore[return-value]  # (waited for)

    def _create_pair(
        self,
        member: int,
        peer: int,
        ids: tuple[bytes, bytes],
        side: _Side,
        ping: torch.Tensor,
        pong: torch.Tensor,
    ) -> Pair:
        """This side's two communicators, connected. They are nonblocking (config.blocking = 0): the inits and
        the connecting exchange return at once and are polled (`settle`) without holding the device's lock.
        A blocking init or first send holding it while it waits for the peer would deadlock a ring: each
        member's maker would hold its device while waiting for a peer whose device another maker holds."""
        nccl, device = self._nccl, self._device_ids[member]
        lock = self._runtime.device_locks.lock(device)
        label = f"rank {self.ranks[member]} with rank {self.ranks[peer]} in group '{self.name}'"
        out_uid, in_uid = (ids[0], ids[1]) if member < peer else (ids[1], ids[0])  # (lo -> hi, hi -> lo)
        waits = (self._abort, self._timeout)
        with lock:
            out = NcclComm(nccl.comm_init_rank_config(2, out_uid, 0, device, False), nccl, device, lock,
                           f"{label} (sending)", blocking=False, waits=waits)  # fmt: skip
            into = NcclComm(nccl.comm_init_rank_config(2, in_uid, 1, device, False), nccl, device, lock,
                            f"{label} (receiving)", blocking=False, waits=waits)  # fmt: skip
        out_stream, in_stream = side.send_stream, side.recv_stream
        try:
            describe = lambda: self._describe_pair_timeout(member, peer)  # noqa: E731
            out.settle(self._abort, self._timeout, describe)
            into.settle(self._abort, self._timeout, describe)
            # one byte each way, grouped: NCCL connects both directions (on first use)
            with lock, nccl_group(nccl):
                nccl.send(ping, 1, out.raw, out_stream)
                nccl.recv(pong, 0, into.raw, in_stream)
            out.settle(self._abort, self._timeout, describe)
            into.settle(self._abort, self._timeout, describe)
        except BaseException:
            for comm in (out, into):  # (nonblocking: abort is allowed at any point, "Fault Tolerance")
                comm.abort("its creation was given up")
            raise
        self._cuda.record_stream(ping, out_stream)
        self._cuda.record_stream(pong, in_stream)
        return Pair(out, into, out_stream, in_stream)

    def _describe_pair_timeout(self, member: int, peer: int) -> str:
        return (
            f"point to point between rank {self.ranks[member]} and rank {self.ranks[peer]} (group '{self.name}'): "
            f"rank {self.ranks[member]} waited {self._timeout:g} s for rank {self.ranks[peer]} to make their NCCL "
            "communicators; the first message between two ranks is a meeting of both (NCCL creates and connects "
            f"their communicators then): does rank {self.ranks[peer]} ever receive from or send to it?"
        )

    def _pair_communicators(self) -> list[NcclComm]:
        """Every pair communicator of this process's members (the caller holds _lock)."""
        return [
            c
            for side in self._sides.values()
            if side.pair is not None
            for c in (side.pair.send, side.pair.recv)
        ]

    def _end_p2p(self) -> None:
        """The end of the launch: hand the sides' streams back; wait for makers that finished (a maker still
        meeting a peer that never came is given up, as a stuck thread after a stop is)."""
        with self._lock:
            sides = list(self._sides.items())
        for (member, _), side in sides:
            device = self.devices[member]
            self._runtime.streams.release((device, device), (side.send_stream, side.recv_stream))
            maker = side.maker
            if maker is not None and (side.pair is not None or side.error is not None):
                maker.join()
