"""`graphed_step`: a rank's whole training step as one CUDA graph, replayed with one call.

    step = threadpar.graphed_step(train_step, warmup_steps=3)   # inside a rank
    for x, y in batches:
        loss = step(x, y)   # warm-up: eager; then captured once; then replayed

A step's host work in eager PyTorch is milliseconds of Python per rank, and a process's rank threads share
one GIL; a replay is one call that releases it (torch/csrc/cuda/Graph.cpp binds CUDAGraph.replay without
the GIL). The first `warmup_steps` calls run eagerly (they make the communicators, DDP's buckets, the
optimizer's state); the next captures `fn` on the arguments' static copies (the process's ranks capture
in turns: runtime/capture_turns.py) and replays it once, which is that step; every later call copies its
tensor arguments into the static copies and replays. What `fn` returned at capture is returned by every
call: the same tensors, overwritten by each replay (clone what you keep), as with torch.cuda.graph.

The last warm-up call is the rehearsal: the point-to-point layer notes the messages it sends and receives,
and the capture follows that script (a receive in a capture cannot wait for the sender's announcement of a
message's shape: the sender captures at another time, and replays announce nothing). The rehearsal and the
capture run backward on the rank's own thread (autograd's device threads off, runtime/autograd_threads.py),
where the thread-local marks of comm/common/graph_capture.py are.

What the step may do is what a CUDA graph can hold: device work only (no `.item()`, no printing of
tensors, no branch on a tensor's value: refused at capture with the op and the line), fixed shapes, its
collectives on the nccl backend, an optimizer with `capturable=True`. Python in the step runs once, at
capture. Dropout from the rank's generators draws new numbers at every replay (they are registered with the
graph: torch's graph-safe generator states). On other backends (CPU threads, ranks sharing a GPU, whose
collectives meet on the host) the step runs eagerly, with a note.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from threadpar.comm.common import graph_capture
from threadpar.comm.handle import spec
from threadpar.errors import CollectiveTimeoutError, ConfigError
from threadpar.runtime import context
from threadpar.runtime.autograd_threads import backward_on_this_thread
from threadpar.runtime.devices import say_once


def graphs_here() -> bool:
    """Whether a graphed step captures on the calling rank (the nccl backend); else it runs eagerly. (Decide
    an optimizer's `capturable` by it: torch refuses capturable optimizers on CPU tensors.)"""
    return context.current().world.backend == "nccl"


def graphed_step(fn: Callable[..., Any] | None = None, *, warmup_steps: int = 3) -> Any:
    """`fn` as a GraphedStep of the calling rank (also a decorator: `@graphed_step(warmup_steps=2)`)."""
    if fn is None:
        return lambda f: GraphedStep(f, warmup_steps=warmup_steps)
    return GraphedStep(fn, warmup_steps=warmup_steps)


class GraphedStep:
    def __init__(self, fn: Callable[..., Any], *, warmup_steps: int = 3) -> None:
        if not callable(fn):
            raise ConfigError(f"graphed_step needs a function (the training step), got {fn!r}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ConfigError(
                f"warmup_steps must be an int >= 1, got {warmup_steps!r}: the eager steps before the capture make "
                "the communicators, DDP's buckets and the optimizer's state, which a graph cannot make"
            )
        ctx = context.current()
        self._fn = fn
        self.warmup_steps = warmup_steps
        self._ctx = ctx
        self.graphed = graphs_here()
        if not self.graphed:
            say_once(
                f"graphed_step runs the step eagerly on the {ctx.world.backend} backend: CUDA graphs need the nccl "
                "backend (one rank per GPU), whose collectives a graph can hold"
            )
        self.calls = 0
        self.capture_seconds: float | None = None
        self._graph: Any = None
        self._static: list[Any] = []  # the flattened arguments the graph reads: tensors it owns, the rest
        self._spec: Any = None
        self._outputs: Any = None
        self._plain = False  # the arguments are tensors only (the replay's fast path)
        self._watch: _ReplayWatch | None = None
        self._script = graph_capture.Script()  # the rehearsal's point to point (graph_capture.py)
        self._ended = False  # the launch ended: the graph was reset with it (_release)
        # Guards _graph against a release from another thread (the watchdog's abort) while the rank replays.
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._ended:
            raise ConfigError(
                f"this graphed step of rank {self._ctx.rank} belongs to a launch that has ended: its CUDA graph was "
                "reset then (NCCL frees no communicator while a graph that captured it lives); make a new "
                "graphed_step in the new launch"
            )
        if context.current() is not self._ctx:
            raise ConfigError(
                f"this graphed step belongs to rank {self._ctx.rank}; each rank makes its own graphed_step"
            )
        self.calls += 1
        if not self.graphed or self.calls < self.warmup_steps:
            return self._fn(*args, **kwargs)
        if self.calls == self.warmup_steps:  # the rehearsal: what point to point sends, the capture follows
            with graph_capture.rehearsing(self._script), backward_on_this_thread(True):
                return self._fn(*args, **kwargs)
        if self._graph is None:
            self._capture(args, kwargs)
        else:
            self._copy_in(args, kwargs)
        self._replay()
        return self._outputs

    @property
    def replays(self) -> int:
        return max(0, self.calls - self.warmup_steps) if self.capture_seconds is not None else 0

    # capture ----------------------------------------------------------------------------------------------------
    def _capture(self, args: tuple, kwargs: dict) -> None:
        leaves, self._spec = tree_flatten((args, kwargs))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.device != self._ctx.device:
                raise ConfigError(
                    f"graphed step on rank {self._ctx.rank}: argument {i} ({spec(leaf)}) is on {leaf.device}, not on "
                    f"this rank's device {self._ctx.device}: a CUDA graph reads its inputs from device memory, which "
                    "each call copies them into; move it with .to(threadpar.get_device()) before the step"
                )
        self._static = [_static_copy(leaf) for leaf in leaves]
        self._plain = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        static_args, static_kwargs = tree_unflatten(self._static, self._spec)
        ctx, world = self._ctx, self._ctx.world
        cuda, runtime = world.cuda_api(), world.nccl_runtime()
        generators = [ctx.generator, *ctx.rng_tracker.generators()]

        def capture() -> Any:
            graph = cuda.graph()
            current = cuda.current_stream(ctx.device)
            stream = runtime.streams.acquire(cuda, ctx.device)  # (a side stream no live group holds)
            try:
                ready = cuda.event()
                ready.record(current)
                stream.wait_event(ready)  # (the capture follows the warm-up's work)
                start = time.perf_counter()
                with (
                    runtime.watchdog.paused(),
                    backward_on_this_thread(True),
                    cuda.capture(graph, stream, generators),
                ):
                    begin = cuda.event()
                    begin.record(stream)  # (where point-to-point receives fork from: graph_capture.Script)
                    with graph_capture.marked(self._script, begin):
                        outputs = self._fn(*static_args, **static_kwargs)
                self.capture_seconds = time.perf_counter() - start
            finally:
                runtime.streams.release([ctx.device], [stream])
            return graph, outputs

        self._graph, self._outputs = world.capture_turns().take(ctx.rank, capture)
        self._watch = _ReplayWatch(self._ctx, cuda)
        runtime.watchdog.watch(self._watch)
        world.on_close(lambda failed: runtime.watchdog.unwatch(self._watch))
        world.keep_graph(self._release)

    def _release(self, wait: bool) -> None:
        """Before the launch's communicators are destroyed or aborted (World.release_graphs): NCCL >= 2.26 waits
        in the last destroy or abort of a clique until every CUDA graph that captured work on it is destroyed
        (src/init.cc, commDestroySync, localPersistentRefs), so the graph goes first. At a clean end its replays
        have finished (`wait`: synchronize); on a failure they may be stuck on a peer that never came, so it is
        reset without waiting (CUDA frees an executing graph once it completes, which the abort makes happen).
        The rank thread may be replaying (the watchdog aborts from its own thread): `_lock` orders them."""
        with self._lock:
            graph, self._graph, self._ended = self._graph, None, True
        if graph is None:
            return
        try:
            if wait:
                self._ctx.world.cuda_api().synchronize(self._ctx.device)
        finally:
            graph.reset()

    def _copy_in(self, args: tuple, kwargs: dict) -> None:
        if self._plain and not kwargs and len(args) == len(self._static):  # (the common case: tensors only)
            for static, new in zip(self._static, args):
                if new is not static:
                    if (
                        not isinstance(new, torch.Tensor)
                        or new.shape != static.shape
                        or new.dtype != static.dtype
                        or new.device != static.device
                    ):
                        break  # (the general path below says what is wrong)
                    static.copy_(new)
            else:
                return
        leaves, spec_now = tree_flatten((args, kwargs))
        if spec_now != self._spec:
            raise ConfigError(
                f"graphed step on rank {self._ctx.rank}: called with arguments shaped {spec_now}, captured with "
                f"{self._spec}: a CUDA graph replays the arguments it was captured with"
            )
        for i, (static, new) in enumerate(zip(self._static, leaves)):
            if isinstance(static, torch.Tensor):
                if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (
                    static.shape,
                    static.dtype,
                    static.device,
                ):
                    got = spec(new) if isinstance(new, torch.Tensor) else repr(new)
                    raise ConfigError(
                        f"graphed step on rank {self._ctx.rank}: argument {i} is {got}, captured as {spec(static)} "
                        f"on {static.device}: a CUDA graph replays fixed shapes (pad or bucket the inputs, or make "
                        "a graphed step per shape)"
                    )
                if new is not static:
                    static.copy_(new)
            elif new != static:
                raise ConfigError(
                    f"graphed step on rank {self._ctx.rank}: argument {i} is {new!r}, captured as {static!r}: "
                    "what is not a tensor is frozen into the graph at capture"
                )

    def _replay(self) -> None:
        with self._lock:  # (a release from the watchdog's thread resets the graph: not while it launches)
            if self._graph is None:
                raise ConfigError(
                    f"this graphed step of rank {self._ctx.rank} belongs to a launch that has ended or is stopping: "
                    "its CUDA graph was reset"
                )
            self._graph.replay()
        assert self._watch is not None
        self._watch.replayed(self.replays)


def _static_copy(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        copy = leaf.detach().clone()
        return copy.requires_grad_(leaf.requires_grad) if leaf.is_leaf else copy
    return leaf


class _ReplayWatch:
    """The watchdog's view of a graphed step (watchdog.py): a replay's NCCL kernels are not issued through
    threadpar's communicators, so the group's probes do not see them; an event after each replay does."""

    def __init__(self, ctx: Any, cuda: Any) -> None:
        self._ctx = ctx
        self._cuda = cuda
        self._pending: collections.deque[tuple[Any, int, float]] = (
            collections.deque()
        )  # (event, replay, since)
        self._failed = False

    def replayed(self, number: int) -> None:
        """Called by the rank thread after a replay; the watchdog thread reads `_pending` (a deque: appends
        and pops are atomic in both builds, DESIGN.md rule 10)."""
        event = self._cuda.event()
        event.record(self._cuda.current_stream(self._ctx.device))
        self._pending.append((event, number, time.monotonic()))

    def watch_tick(self, now: float) -> None:
        world = self._ctx.world
        if self._failed or world.abort.is_set:
            return
        pending = self._pending
        while pending and pending[0][0].query():
            pending.popleft()
        if pending and now - pending[0][2] > world.timeout:
            _, number, _ = pending[0]
            self._failed = True
            world.fail(
                self._ctx.rank,
                CollectiveTimeoutError(
                    f"replay {number} of rank {self._ctx.rank}'s graphed step has not finished on the device within "
                    f"{world.timeout:g} s: a collective in it waits for a peer whose replay never came (a rank that "
                    "stopped calling its graphed step, or called it fewer times)"
                ),
            )
