"""Host cost of point to point on the nccl backend, measured without a GPU, before and after issue 39.

    python -m benchmarks.p2p_host_cost            # 7 repeats
    python -m benchmarks.p2p_host_cost --quick

A *null* device (benchmarks/nccl_launch.py's: streams and events that do nothing) whose NCCL models what costs
host time in point to point: a nonblocking communicator's launch stays "in progress" while a thread of NCCL's
does it (from NCCL 2.23 every nonblocking group end: src/group.cc, ncclGroupEndInternal), here for
`--launch-us` microseconds; a blocking one's launch returns at once. Its sends and receives move the bytes on
the host (a loopback, so that a pipeline computes on what it receives; tiny tensors: the copies are noise).
Everything else is threadpar's own host work on a rank thread.

Side by side, in one process:
- "before": the code before issue 39, reproduced here: point to point on a pair of nonblocking two-rank
  communicators per ordered pair of ranks (a snapshot copy per send), and each launch on one of them waited
  for with time.sleep(1 ms) polls while holding the device's lock (the old NcclComm.launch_locked).
- "plain send/recv, after": the same buffered, tagged path, its launches now waited for with yields and
  without the lock (torch's NCCL_CHECK_TIMEOUT), no snapshot once the pair exists.
- "exchange (pipelines, ring attention)": ProcessGroup.exchange on the group's own blocking communicator.
Per call: a rank thread's send (rank 1 held meanwhile), then the peer's receive of the same messages (posted
once sent, so no host wait for the sender). And one 1F1B step of a pp = 4 x 32-microbatch pipeline of tiny
Linear stages (the executor's host work per message): over pair communicators before, over the PP group's
communicator (pipeline/transport.py) after. Medians of repeats; the issue's goal: <= 20 us per send or receive.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import threadpar
from benchmarks.harness import fmt_time, machine_line, repeats_of, repeats_parser, table
from benchmarks.nccl_launch import NullCuda, NullNccl
from threadpar.comm.nccl import comm as nccl_comm
from threadpar.comm.nccl.library import IN_PROGRESS, SUCCESS
from threadpar.pipeline import PipelineParallel, build_chunks
from threadpar.pipeline import executor as pipeline_executor
from threadpar.pipeline.transport import HEADER
from threadpar.runtime.launch import _Launch
from threadpar.runtime.world import World
from threadpar.topology import Layout

LEGACY_POLL_S = 1e-3  # the old NcclComm.SETTLE_POLL_S, slept with the device's lock held


class NullComm:
    __slots__ = ("blocking", "busy_until", "rank", "size", "uid")

    def __init__(self, uid: bytes, rank: int, size: int, blocking: bool) -> None:
        self.uid, self.rank, self.size, self.blocking = uid, rank, size, blocking
        self.busy_until = 0.0  # a nonblocking launch in progress until then


class ModelNccl(NullNccl):
    """NCCL that does nothing on a device, but keeps host time where NCCL spends it (module docstring)."""

    def __init__(self, launch_s: float, loopback: bool) -> None:
        self.launch_s = launch_s
        self.loopback = loopback  # move the bytes (a pipeline computes on them), or not (per-call timings)
        self._lock = threading.Lock()
        self._matched = threading.Condition(threading.Lock())  # the loopback's queues
        self._ids = 0
        self._joined: dict[bytes, int] = {}
        self._queues: dict[tuple[bytes, int, int], deque[Any]] = {}  # (clique, src, dst) -> sends or receives
        self._local = threading.local()

    def version(self) -> tuple[int, int, int]:
        return (2, 27, 3)

    def get_unique_id(self) -> bytes:
        with self._lock:
            self._ids += 1
            return self._ids.to_bytes(8, "little").ljust(128, b"\0")

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, device: int) -> NullComm:
        return self._join(nranks, unique_id, rank, True)

    def comm_init_rank_config(self, nranks, unique_id, rank, device, blocking) -> NullComm:
        return self._join(nranks, unique_id, rank, blocking)

    def _join(self, nranks: int, uid: bytes, rank: int, blocking: bool) -> NullComm:
        with self._lock:
            self._joined[uid] = self._joined.get(uid, 0) + 1
        return NullComm(uid, rank, nranks, blocking)

    def comm_get_async_error(self, comm: NullComm) -> int:
        with self._lock:
            joined = self._joined.get(comm.uid, 0) >= comm.size
        return IN_PROGRESS if not joined or time.perf_counter() < comm.busy_until else SUCCESS

    def group_start(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1:
            self._local.comms = set()

    def group_end(self) -> int:
        self._local.depth -= 1
        if self._local.depth:
            return SUCCESS
        nonblocking = [c for c in self._local.comms if not c.blocking]
        until = time.perf_counter() + self.launch_s
        for comm in nonblocking:
            comm.busy_until = until
        return IN_PROGRESS if nonblocking else SUCCESS

    def send(self, tensor: torch.Tensor, peer: int, comm: NullComm, stream: Any) -> None:
        self._point_to_point(comm, comm.rank, peer, tensor, sending=True)

    def recv(self, tensor: torch.Tensor, peer: int, comm: NullComm, stream: Any) -> None:
        self._point_to_point(comm, peer, comm.rank, tensor, sending=False)

    def _point_to_point(
        self, comm: NullComm, src: int, dst: int, tensor: torch.Tensor, sending: bool
    ) -> None:
        """Loopback: the k-th send of a pair meets its k-th receive, whichever comes first. A pipeline's first
        step reads each message's header on the host right after receiving it, which on a GPU waits for the
        device; the null device runs nothing, so that receive waits here for its send instead."""
        grouped = getattr(self._local, "depth", 0) > 0
        if grouped:
            self._local.comms.add(comm)
        if self.loopback:
            self._match(comm, src, dst, tensor, sending)
        if not grouped:  # (an op outside a group is a group of its own)
            self.group_start()
            self._local.comms.add(comm)
            self.group_end()

    def _match(self, comm: NullComm, src: int, dst: int, tensor: torch.Tensor, sending: bool) -> None:
        # (the backend passes bytes: a header is HEADER int64s; this benchmark's messages are smaller)
        header = not sending and tensor.numel() * tensor.element_size() == HEADER * 8
        with self._matched:
            queue = self._queues.setdefault((comm.uid, src, dst), deque())
            if header and not (queue and queue[0][0]):
                self._matched.wait_for(lambda: bool(queue) and queue[0][0], timeout=60)
            if queue and queue[0][0] != sending:
                _, other = queue.popleft()
                send, recv = (tensor, other) if sending else (other, tensor)
                _alias(recv).copy_(send)  # (the send's snapshot below keeps its bytes)
            else:
                queue.append((sending, tensor.clone() if sending else tensor))
                self._matched.notify_all()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory with a version counter of its own: what a kernel writes through (a receive posted ahead
    is written after autograd may have saved its tensor; the double does the same: fake_device._kernel_alias)."""
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )


class ModelCuda(NullCuda):
    def __init__(self, launch_s: float, loopback: bool) -> None:
        super().__init__()
        self.nccl = ModelNccl(launch_s, loopback)


def legacy_launch(self: Any, issue: Callable[[Any], None], *streams: Any) -> None:
    """NcclComm.launch before issue 39: the wait for a nonblocking launch slept under the device's lock."""
    with self.lock:
        self.launch_locked(issue, streams)
        if not self.blocking:
            while self._state() == IN_PROGRESS:
                time.sleep(LEGACY_POLL_S)


@contextlib.contextmanager
def before() -> Iterator[None]:
    """The code before issue 39: the old launch, pipelines on the pair communicators of plain send/recv."""
    saved_launch, saved_transport = nccl_comm.NcclComm.launch, pipeline_executor.Transport
    nccl_comm.NcclComm.launch = legacy_launch  # type: ignore[method-assign]
    pipeline_executor.Transport = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        nccl_comm.NcclComm.launch = saved_launch  # type: ignore[method-assign]
        pipeline_executor.Transport = saved_transport  # type: ignore[misc]


def run_model(fn: Callable[[], Any], n: int, launch_s: float, loopback: bool, **layout: int) -> list[Any]:
    world = World(
        layout=Layout.build(n, **layout),
        backend="nccl",
        devices=(torch.device("cpu"),) * n,
        timeout=120.0,
        seed=0,
        intraop_threads=1,
        cuda=ModelCuda(launch_s, loopback),
    )
    return _Launch(world, fn, (), {}).run()


def p2p_calls(
    path: str, t: torch.Tensor, out: list[torch.Tensor]
) -> tuple[Callable[[], Any], Callable[[int], Any]]:
    """Rank 0's send of `t` to rank 1 and rank 1's receive #i into out[i], on `path`: "exchange" (the group's
    own communicator, its pairs connected first) or plain send/recv."""
    group = threadpar.get_group()
    if path == "exchange":
        group.connect([(0, 1), (1, 0)])
        return (lambda: group.exchange(sends=[(1, t)])), (
            lambda i: group.exchange(recvs=[(0, out[i])]).wait()
        )
    return (lambda: threadpar.send(t, dst=1)), (lambda i: threadpar.recv(out[i], src=0))


def timed_calls(
    turn: threading.Barrier,
    send: Callable[[], Any],
    receive: Callable[[int], Any],
    calls: int,
    repeats: int,
    sync: Callable[[], Any] = lambda: None,
) -> tuple[float, float]:
    """Medians over `repeats` of the host time of one send on rank 0 and of one receive on rank 1 (seconds; 0
    on the other rank), `calls` of each per repeat, the ranks taking turns; `sync` after each repeat."""
    rank = threadpar.get_rank()
    sends, recvs = [], []
    for _ in range(repeats):
        turn.wait()
        if rank == 0:
            began = time.perf_counter()
            for _ in range(calls):
                send()
            sends.append((time.perf_counter() - began) / calls)
        turn.wait()
        if rank == 1:
            began = time.perf_counter()
            for i in range(calls):
                receive(i)
            recvs.append((time.perf_counter() - began) / calls)
        sync()
    return statistics.median(sends or [0.0]), statistics.median(recvs or [0.0])


def per_call(path: str, calls: int, repeats: int, launch_s: float) -> tuple[float, float]:
    """Median host time of one send on rank 0 and of one receive on rank 1 (seconds)."""
    turn = threading.Barrier(2)

    def body() -> tuple[float, float]:
        send, receive = p2p_calls(path, torch.ones(16), [torch.empty(16) for _ in range(calls)])
        for _ in range(3):  # the pair's communicators, warm paths
            if threadpar.get_rank() == 0:
                send()
            else:
                receive(0)
        return timed_calls(turn, send, receive, calls, repeats)

    results = run_model(body, 2, launch_s, loopback=False)
    return results[0][0], results[1][1]


def pipeline_step(steps: int, launch_s: float, pp: int = 4, n: int = 32) -> float:
    """Median host time of one 1F1B train_step (seconds), after two warm-up steps. (The stages' agreement
    check when the pipeline is built is an all-gather, which the null device does not compute: left out.)"""
    width = 8

    def body() -> float:
        torch.manual_seed(0)
        layers = [nn.Linear(width, width) for _ in range(pp)]
        chunks = build_chunks(layers, pp_size=pp, pp_rank=threadpar.get_coords().pp)
        pipe = PipelineParallel(chunks, loss_fn=lambda y, t: (y - t).square().mean(), num_microbatches=n)
        x, y = torch.randn(n, width), torch.randn(n, width)
        times = []
        for i in range(steps + 2):
            began = time.perf_counter()
            pipe.train_step(x, y)
            if i >= 2:
                times.append(time.perf_counter() - began)
        return statistics.median(times)

    check = pipeline_executor.PipelineParallel._check_agreement
    pipeline_executor.PipelineParallel._check_agreement = lambda self: None  # type: ignore[method-assign]
    try:
        return max(run_model(body, pp, launch_s, loopback=True, pp=pp))
    finally:
        pipeline_executor.PipelineParallel._check_agreement = check  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = repeats_parser(__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--launch-us", type=float, default=30.0, help="NCCL's launch thread (nonblocking)")
    parser.add_argument("--steps", type=int, default=5, help="1F1B steps timed")
    args = parser.parse_args(argv)
    repeats = repeats_of(args)
    launch_s = args.launch_us * 1e-6
    print(
        f"# host time of point to point on a rank thread, null device with NCCL's nonblocking launch thread "
        f"modelled at {args.launch_us:g} us ({machine_line()}); median of {repeats} repeats of {args.calls} calls\n"
    )
    with before():
        old = per_call("plain", args.calls, repeats, launch_s)
    plain = per_call("plain", args.calls, repeats, launch_s)
    fast = per_call("exchange", args.calls, repeats, launch_s)
    rows = [
        ["before: send/recv on pair communicators, 1 ms sleeps under the lock", *map(fmt_time, old), "1.00x"],
        [
            "plain send/recv, after (pairs, yields without the lock)",
            *map(fmt_time, plain),
            f"{old[0] / plain[0]:.1f}x",
        ],
        [
            "exchange on the group's communicator (pipelines, ring attention)",
            *map(fmt_time, fast),
            f"{old[0] / fast[0]:.1f}x",
        ],
    ]
    print(table(["path", "send", "receive", "before / this (send)"], rows))
    with before():
        step_before = pipeline_step(args.steps, launch_s)
    step_after = pipeline_step(args.steps, launch_s)
    print(f"\n# one 1F1B step, pp = 4 x 32 microbatches of Linear({8}) stages; median of {args.steps}\n")
    print(
        table(
            ["pipeline messages", "step host time", "before / after"],
            [
                ["before: pair communicators (plain send/recv, old launch)", fmt_time(step_before), "1.00x"],
                [
                    "after: the PP group's communicator (Transport)",
                    fmt_time(step_after),
                    f"{step_before / step_after:.1f}x",
                ],
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
