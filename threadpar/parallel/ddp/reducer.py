"""The Reducer: gradient buckets all-reduced during backward, overlapping the rest of it.

One synchronized backward (InfiniTrain's Reducer and torch's reducer.cpp, in Python):

1. A parameter's post-accumulate-grad hook marks it ready (with gradient_as_bucket_view it first makes
   sure param.grad is the parameter's view into its bucket's flat buffer).
2. When all of a bucket's parameters are ready, its reduction starts asynchronously on the rank's
   communication worker: by default one coalesced all-reduce that averages the gradients in place (no
   copies), else the registered comm hook (whose flat result is written back into the gradients on the
   worker, as soon as it is there). Buckets start strictly in order (a bucket ready early waits for those
   before it), so every rank issues the same collectives in the same order.
3. At the end of backward (an autograd engine callback queued by the first hook), the reducer launches
   what is left and waits for every bucket. The last bucket is always launched there, synchronously: the
   rank would wait for it at once anyway, and on the threads backend it then runs on the rank thread
   instead of hopping to the comm worker and back (measured: 1.5-3 ms of a 20 ms step on 2 cores; the
   last bucket's gradients are the last to be ready, so it gives up almost no overlap). With
   find_unused_parameters, buckets holding parameters that got no gradient are launched there too. After the first synchronized backward it rebuilds the buckets in the order the
   gradients actually became ready (the group's first rank's order, for all ranks).

Whether a backward synchronizes is decided when its first hook runs, from `require_backward_grad_sync`
(False inside DDP's no_sync()), not at forward time: a pipeline runs several forwards before their
backwards. The hooks use only what was captured when the reducer was built (the ProcessGroup handle and
the launch's stop signal): backward may run on threads without a rank context (PyTorch's device threads).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from threadpar.comm.common.abort import AbortSignal
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.ddp.bucket import Bucket, shares_memory
from threadpar.parallel.ddp.bucketing import TensorSpec, assign_buckets, caps_in_bytes, rebuild_order
from threadpar.parallel.ddp.comm_hooks import CommHook, GradBucket, then

# How many parameter names an error message lists before it says "and N more".
NAMES_SHOWN = 8

# Identifies the running backward (torch.utils.checkpoint uses it too); -1 where torch lacks it.
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class ShardedReduction(Protocol):
    """Takes over the reduction of every bucket (the distributed optimizer's ZeRO-2: a reduce-scatter into
    the optimizer's shards instead of an all-reduce), see `Reducer.shard_reduction`."""

    def gradient_ready(self, index: int) -> None:
        """Parameter `index` (the reducer's) has its gradient of this synchronized backward in param.grad
        (or None: none on this rank); the reduction takes it from there."""
        ...

    def reduce_bucket(self, index: int, scale: float, async_op: bool) -> Work | None:
        """Start reducing bucket `index`, its gradients multiplied by `scale` (zeros for missing ones)."""
        ...

    def backward_done(self, used: list[bool] | None) -> None:
        """After every bucket's reduction finished; `used[i]`: parameter i got a gradient on some rank
        (None: every parameter did)."""
        ...

    def backward_abandoned(self) -> None:
        """The backward failed midway (its reductions are finished): forget what it staged."""
        ...


@dataclass(kw_only=True)
class ReducerOptions:
    """How gradients are bucketed and reduced (DistributedDataParallel's keyword arguments)."""

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    gradient_bucketing: bool = True  # InfiniTrain's gradient_bucketing_enabled

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a non-negative number of MiB, got {value!r}")
            if math.isinf(value):
                raise ConfigError(f"{name}={value} is infinite; pass a large finite number of MiB instead")
        for name in ("gradient_as_bucket_view", "find_unused_parameters", "gradient_bucketing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def caps(self) -> list[int]:
        """Bucket caps in bytes; without bucketing a cap of 0 gives every parameter its own bucket."""
        if not self.gradient_bucketing:
            return [0]
        return caps_in_bytes(self.first_bucket_cap_mb, self.bucket_cap_mb)


def _hook_for(reducer: weakref.ref, index: int) -> Callable[[torch.Tensor], None]:
    # A weak reference: the hooks stay on the parameters, but must not keep a discarded reducer alive.
    def on_grad_accumulated(_: torch.Tensor) -> None:
        target = reducer()
        if target is not None:
            target._mark_ready(index)

    return on_grad_accumulated


class Reducer:
    """Averages the gradients of `params` over `group` during each synchronized backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: ProcessGroup,
        options: ReducerOptions,
        abort: AbortSignal | None = None,
        scale: float = 1.0,
    ) -> None:
        """scale: the gradients are multiplied by it before they are averaged (DDP's sharded MoE experts:
        expert-DP size / DDP group size, see experts.py)."""
        self._params = list(params)
        self._scale = float(scale)
        self._names = list(names)
        self._group = group
        self._options = options
        self._abort = abort
        self._specs = [TensorSpec(p.numel() * p.element_size(), (str(p.device), p.dtype)) for p in params]
        self._lock = threading.Lock()
        self.require_backward_grad_sync = True
        self._hook: CommHook | None = None  # None: the built-in in-place average, without futures
        self._hook_state: Any = group
        self._sharded: ShardedReduction | None = None
        self._ran_backward = False
        self._rebuilt = False
        self._build(assign_buckets(self._specs, options.caps))
        self._reset()
        me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_hook_for(me, i)) for i, p in enumerate(params)]

    # inspection -------------------------------------------------------------------------------------------------
    def bucket_indices(self) -> list[list[int]]:
        """The buckets in launch order, as indices into the reducer's parameters."""
        return [list(b.members) for b in self._buckets]

    def bucket_buffers(self) -> list[torch.Tensor]:
        """The flat buffers allocated so far (all of them with gradient_as_bucket_view)."""
        return [b.buffer for b in self._buckets if b.buffer is not None]

    @property
    def parameter_names(self) -> list[str]:
        return list(self._names)

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    @property
    def group(self) -> ProcessGroup:
        return self._group

    def shard_reduction(self, sharded: ShardedReduction) -> None:
        """Let `sharded` reduce every bucket from now on, and freeze the buckets (its shards follow them)."""
        if self._hook is not None or self._sharded is not None:
            what = "a comm hook" if self._hook is not None else "another distributed optimizer"
            raise ConfigError(
                f"DistributedDataParallel: {what} already reduces this module's gradients; a ZeRO-2 "
                "optimizer reduce-scatters them itself (use one of the two, or stage=1)"
            )
        with self._lock:
            self._sharded = sharded
            self._rebuilt = True

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        if self._hook is not None:
            raise ConfigError("register_comm_hook can be called only once per DistributedDataParallel module")
        if self._sharded is not None:
            raise ConfigError(
                "register_comm_hook: a ZeRO-2 optimizer already reduce-scatters this module's gradients; "
                "a comm hook cannot be combined with it (use stage=1)"
            )
        if self._ran_backward:
            raise ConfigError(
                "register_comm_hook must be called before the first backward through the module"
            )
        if self._group.stream_ordered:
            raise ConfigError(
                f"comm hooks are not supported on group '{self._group.name}': its backend orders operations on "
                "device streams, so a hook's future would never complete on the host; use the default "
                "reduction (no hook)"
            )
        self._hook = hook
        self._hook_state = self._group if state is None else state  # built-in hooks take the group

    def remove_hooks(self) -> None:
        """Detach from the parameters (the module then trains without synchronizing)."""
        for handle in getattr(self, "_handles", ()):
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # e.g. during interpreter shutdown
            self.remove_hooks()

    # buckets ----------------------------------------------------------------------------------------------------
    def _build(self, assignment: list[list[int]]) -> None:
        views = self._options.gradient_as_bucket_view
        self._buckets = [Bucket(members, self._params, views) for members in assignment]
        # parameter index -> (bucket index, position in bucket)
        self._locator = [(0, 0)] * len(self._params)
        for k, bucket in enumerate(self._buckets):
            for slot, i in enumerate(bucket.members):
                self._locator[i] = (k, slot)

    def _reset(self) -> None:
        """Forget the state of the backward that just ended."""
        self._active = False
        self._task = -1
        self._sync = False
        self._ready = [False] * len(self._params)
        self._pending = [len(b.members) for b in self._buckets]
        self._next = 0
        self._ready_order: list[int] = []
        self._placeholders: dict[int, torch.Tensor] = {}  # zeros standing in for missing gradients
        # Whether each parameter had a gradient when it was prepared (a sharded reduction drops param.grad
        # as soon as its bucket is launched, so param.grad no longer says so at the end of backward).
        self._had_grad = [False] * len(self._params)
        for bucket in self._buckets:
            bucket.reduction = None

    # during backward (hook threads) -----------------------------------------------------------------------------
    def _mark_ready(self, index: int) -> None:
        with self._lock:
            task = _graph_task_id()
            if not self._active or task != self._task:
                if self._active:
                    self._abandon()  # the previous backward failed before its end: no callback came
                # First hook of this backward: decide now whether it synchronizes (see module docstring).
                self._active, self._task, self._ran_backward = True, task, True
                self._sync = self.require_backward_grad_sync
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            if not self._sync:
                return  # no_sync: gradients just accumulate in param.grad
            if self._ready[index]:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter '{self._names[index]}' received its gradient twice in "
                    "one backward; reentrant backward (torch.utils.checkpoint with use_reentrant=True) is not "
                    "supported, use use_reentrant=False"
                )
            self._ready[index] = True
            if not self._rebuilt:
                self._ready_order.append(index)
            self._prepare(index)
            if self._sharded is not None:
                self._sharded.gradient_ready(index)
            bucket = self._locator[index][0]
            self._pending[bucket] -= 1
            if bucket == self._next and self._pending[bucket] == 0:
                self._launch_ready_buckets()

    def settle_interrupted_backward(self) -> None:
        """Called before a forward: if the last backward raised midway (so its end callback never came),
        let its all-reduces finish now rather than during the next backward."""
        if self._active and _graph_task_id() == -1:
            with self._lock:
                self._abandon()

    def _abandon(self) -> None:
        """Let the all-reduces of an interrupted backward finish (they use the buffers), then forget it."""
        for bucket in self._buckets:
            if bucket.reduction is not None:
                # That backward already failed and its error was reported then.
                with contextlib.suppress(Exception):
                    bucket.reduction.wait()
        if self._sharded is not None:
            self._sharded.backward_abandoned()
        self._reset()

    def _prepare(self, index: int) -> None:
        """Ready param `index`'s gradient for reduction (zeros stand in for a missing one)."""
        param = self._params[index]
        grad = param.grad
        self._had_grad[index] = grad is not None
        if grad is not None and grad.is_sparse:
            raise TypeError(
                f"DistributedDataParallel: parameter '{self._names[index]}' has a sparse gradient, which is "
                "not supported; use dense gradients (e.g. nn.Embedding(..., sparse=False))"
            )
        if not self._options.gradient_as_bucket_view:
            if grad is None:
                self._placeholders[index] = torch.zeros_like(param)
            return
        bucket, slot = self._locator[index]
        view = self._buckets[bucket].view(slot)
        if grad is None:
            view.zero_()
        elif not shares_memory(grad, view):
            # First iteration, or the grad was set to None (zero_grad(set_to_none=True)): copy it in once
            # and make param.grad the bucket view, so later backwards accumulate straight into the bucket.
            view.copy_(grad)
            param.grad = view

    def _gradient(self, index: int) -> torch.Tensor:
        if self._options.gradient_as_bucket_view:
            bucket, slot = self._locator[index]
            return self._buckets[bucket].view(slot)
        grad = self._params[index].grad
        return self._placeholders[index] if grad is None else grad

    def _launch_ready_buckets(self, *, at_end: bool = False) -> None:
        last_k = len(self._buckets) - 1  # the index of the last bucket
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            k, bucket = self._next, self._buckets[self._next]
            if k == last_k and not at_end and self._hook is None:
                return  # launched by _finish_sync (module docstring, step 3)
            if self._sharded is not None:  # it took the gradients as they became ready
                bucket.reduction = self._sharded.reduce_bucket(k, self._scale, async_op=k != last_k)
                self._next += 1
                continue
            # The gradients of this backward: the ones to average and write to, whatever happens later.
            grads = [self._gradient(i) for i in bucket.members]
            if self._scale != 1.0:
                torch._foreach_mul_(grads, self._scale)
            if self._hook is None:
                # The default: one coalesced all-reduce, in place. Its Work's wait() blocks until done on
                # the threads backend and orders the caller's stream after it on nccl.
                bucket.reduction = self._group.all_reduce_coalesced(grads, ReduceOp.AVG, async_op=k != last_k)
            else:
                flatten = functools.partial(bucket.flatten, grads)
                reduced = self._hook(
                    self._hook_state, GradBucket(k, grads, bucket.params, k == last_k, flatten)
                )
                # Unpacked where the all-reduce completes (the comm worker), overlapping the rest of backward.
                bucket.reduction = then(reduced, functools.partial(self._unpack, bucket, grads))
            self._next += 1

    def _unpack(self, bucket: Bucket, grads: list[torch.Tensor], value: Any) -> None:
        """Put the bucket's averages into its gradients, unless the hook averaged them in place."""
        in_place = isinstance(value, (list, tuple)) and len(value) == len(grads)
        if not (in_place and all(v is g for v, g in zip(value, grads))):
            bucket.scatter(self._result_tensor(value, bucket), grads)

    # end of backward (engine callback) --------------------------------------------------------------------------
    def _finalize(self) -> None:
        with self._lock:
            try:
                if self._sync:
                    self._finish_sync()
            finally:
                self._reset()

    def _finish_sync(self) -> None:
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if missing and not self._options.find_unused_parameters:
            raise ConfigError(
                f"DistributedDataParallel: {len(missing)} parameter(s) got no gradient in this backward on rank "
                f"{self._group.global_rank}: {self._describe(missing)}. Every parameter that requires grad must "
                "take part in the loss, or pass find_unused_parameters=True to DistributedDataParallel (it "
                "also handles parameters used on some ranks or iterations only)"
            )
        for i in missing:
            self._prepare(i)  # the gradient accumulated by earlier no_sync backwards, or zeros
            if self._sharded is not None:
                self._sharded.gradient_ready(i)
            self._pending[self._locator[i][0]] -= 1
        self._launch_ready_buckets(at_end=True)
        used = self._globally_used() if self._options.find_unused_parameters else None
        for bucket in self._buckets:
            if bucket.reduction is not None:  # None: reduced synchronously
                self._wait(bucket.reduction)
        if used is not None and self._sharded is None:  # (a sharded reduction settles its own)
            self._settle_unused(used)
        if not self._rebuilt:
            self._rebuild()
        if self._sharded is not None:
            self._sharded.backward_done(used)

    def _globally_used(self) -> list[bool]:
        """Which parameters have a gradient on at least one rank (the others keep grad None everywhere)."""
        device = self._params[0].device
        flags = torch.tensor(self._had_grad, dtype=torch.uint8, device=device)
        self._group.all_reduce(flags, ReduceOp.MAX)  # queued behind the bucket all-reduces
        return [bool(f) for f in flags.tolist()]

    def _wait(self, pending: Work | torch.futures.Future) -> None:
        try:
            pending.wait()
        except BaseException:
            if self._abort is not None:
                self._abort.raise_if_set()  # a peer failed: report this rank as stopped, not as a cause
            raise

    def _result_tensor(self, value: Any, bucket: Bucket) -> torch.Tensor:
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        numel = sum(bucket.numels)
        if not isinstance(value, torch.Tensor) or value.numel() != numel:
            got = f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor) else repr(value)
            raise TypeError(
                f"DistributedDataParallel: the comm hook's future for bucket {self._buckets.index(bucket)} must "
                f"hold a flat tensor of {numel} elements like bucket.buffer(), or the list "
                f"bucket.gradients() averaged in place; got {got}"
            )
        return value.reshape(-1)

    def _settle_unused(self, used: list[bool]) -> None:
        """A parameter without a gradient here but with one on another rank gets the average too; one
        without a gradient anywhere keeps grad None, as it would in a single process."""
        for i, param in enumerate(self._params):
            if param.grad is None and used[i]:
                param.grad = self._gradient(i)  # its view, or the placeholder that now holds the average

    def _rebuild(self) -> None:
        """Rebuild the buckets in the order gradients became ready, once (the first synchronized backward)."""
        self._rebuilt = True
        current = [i for b in self._buckets for i in b.members]
        order = torch.tensor(rebuild_order(self._ready_order, current, len(self._params)), dtype=torch.int64)
        # Every rank must bucket alike, and ready orders may differ between ranks: take the first rank's.
        order = order.to(self._params[0].device)
        self._group.broadcast(order, src=self._group.ranks[0])
        assignment = assign_buckets(self._specs, self._options.caps, order.tolist())
        if assignment == self.bucket_indices():
            return
        views = self._options.gradient_as_bucket_view
        old_views = [self._buckets[b].view(slot) for b, slot in self._locator] if views else []
        self._build(assignment)
        for i, old_view in enumerate(old_views):
            param = self._params[i]
            if param.grad is not None and shares_memory(param.grad, old_view):
                new_view = self._gradient(i)
                new_view.copy_(old_view)
                param.grad = new_view

    def _describe(self, indices: list[int]) -> str:
        names = [f"'{self._names[i]}'" for i in indices[:NAMES_SHOWN]]
        more = f" and {len(indices) - NAMES_SHOWN} more" if len(indices) > NAMES_SHOWN else ""
        return ", ".join(names) + more
