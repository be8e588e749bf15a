"""ZeroRedundancyOptimizer: a distributed optimizer (ZeRO-1/2) around any element-wise torch optimizer.

    model = DistributedDataParallel(net)                     # in every rank, as usual
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=1, lr=3e-4)
    loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

Each parameter is sharded over the group DDP averages its gradient over (DP; DP x CP under context
parallelism; expert-DP for MoE experts sharded over an EP group), following Megatron's distributed
optimizer: every DDP bucket is laid out flat and split evenly, so this rank owns a contiguous range of every
bucket (shard_bucket.py). `.optim` is the torch optimizer over the pieces in this rank's ranges; its state is
1/P of the dense state. A step: the pieces take their gradients, `.optim` steps them, and one in-place
all-gather per bucket gives every rank the updated parameters.

- stage=1: DDP all-reduces gradients as without ZeRO; the pieces' gradients are views of them.
- stage=2: DDP's bucket reductions become reduce-scatters into the optimizer's gradient shards (still
  overlapped with backward). Each gradient is copied into its bucket's reduce-scatter input as soon as
  autograd has it, and its `param.grad` is dropped right then (as DeepSpeed's ZeRO-2 fills its reduction
  bucket); the input lives until its reduce-scatter is done, and one bucket is reduced while the next fills.
  After a synchronizing backward `param.grad` is None and only this rank's range of the averaged gradient
  remains (measured: benchmarks/zero_memory.py). DDP's buckets are
  frozen as they are when the optimizer is built (no rebuild after the first step).

bf16/fp16 parameters get fp32 master weights for the range (optimizer math in fp32; the parameters get the
rounded result), unless master_weights=False. TP shards are sharded again over DP; pipeline chunks each
bring their own DDP buckets. `state_dict()` is the dense state of a plain optimizer over the same parameters
(a collective), so threadpar.checkpoint saves it unsplit and a run resumes with or without ZeRO, on any dp.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from threadpar.comm.common.work import Work
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.grad_holder import mark_grad_holder
from threadpar.parallel.groups import resolve_group
from threadpar.parallel.zero.bucketing import build_shard_buckets
from threadpar.parallel.zero.clip import clip_shard_grad_norm_
from threadpar.parallel.zero.shard import Shard
from threadpar.parallel.zero.state import (
    StateSchema,
    check_dense,
    gather_dense,
    load_dense,
    packed_param_groups,
    probe_schema,
)

STATE_FORMAT = "threadpar-zero/1"
ZERO2_INSTEAD = (
    "clip with optimizer.clip_grad_norm_(max_norm) (it clips the shards), unscale with "
    "LossScaler.step(optimizer, optimizer.grad_holders()), and leave the reduction to DistributedDataParallel"
)


class _ReducerShards:
    """ZeRO-2's side of one DDP reducer (threadpar.parallel.ddp.reducer.ShardedReduction)."""

    def __init__(self, shards: dict[int, Shard], params: list[torch.nn.Parameter]) -> None:
        self.shards = shards  # DDP bucket index -> its shard
        where = {id(p): (s, i) for s in shards.values() for i, p in enumerate(s.bucket.params)}
        self.slots = [where[id(p)] for p in params]  # reducer parameter index -> (shard, index in bucket)
        self.in_flight: Work | None = None  # the last bucket's reduce-scatter, until the next bucket starts

    def gradient_ready(self, index: int) -> None:
        shard, j = self.slots[index]
        if not shard.staging and self.in_flight is not None:
            # A bucket's reduce-scatter input is let go of when the collective is done: at most one in flight
            # (and one filling) bounds backward's gradient memory at two buckets; the wait is short, as
            # backward computed at least one more gradient since that bucket was launched. On a stream-ordered
            # group (nccl) wait() would make backward's stream wait for the comm stream: not done there (the
            # caching allocator frees each input once its comm stream is done with it, record_stream).
            work, self.in_flight = self.in_flight, None
            if not shard.bucket.group.stream_ordered:
                work.wait()
        shard.stage_grad(j)

    def reduce_bucket(self, index: int, scale: float, async_op: bool) -> Work | None:
        work = self.shards[index].reduce_scatter(scale, async_op)
        self.in_flight = work
        return work

    def backward_abandoned(self) -> None:
        self.in_flight = None
        for shard in self.shards.values():
            shard.drop_staged()

    def backward_done(self, used: list[bool] | None) -> None:
        self.in_flight = None
        per_shard: dict[int, list[bool]] = {}
        for i, (shard, j) in enumerate(self.slots):
            flags = per_shard.setdefault(id(shard), [False] * len(shard.bucket.params))
            flags[j] = True if used is None else used[i]
        for shard in self.shards.values():
            shard.reduction_done(per_shard[id(shard)])


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shards `optimizer_class`'s state (ZeRO-1) and optionally the reduced gradients (ZeRO-2) over the
    DP group; see the module docstring. `process_group=None` shards each parameter over the group its DDP
    reduces it over; a group (handle, axis or name) shards all of them over it (parameters that no DDP
    wraps then need their gradients averaged by the caller, as with torch's ZeroRedundancyOptimizer)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        stage: int = 1,
        process_group: ProcessGroup | str | None = None,
        master_weights: bool = True,
        **defaults: Any,
    ) -> None:
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ConfigError(
                f"ZeroRedundancyOptimizer: stage={stage!r}; use stage=1 (shard optimizer state) or stage=2 "
                "(also keep only this rank's shard of the reduced gradients)"
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ConfigError(
                f"ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer class such as "
                f"torch.optim.AdamW, got {optimizer_class!r}"
            )
        group = None if process_group is None else resolve_group(process_group, "DP")
        self._initialized = False
        super().__init__(params, defaults)
        self.stage = stage
        self.optimizer_class = optimizer_class
        self.process_group = group
        named = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in named}) != len(named):
            raise ConfigError("ZeroRedundancyOptimizer: a parameter appears more than once in params")
        self._names = {id(p): f"#{i} {tuple(p.shape)}" for i, p in enumerate(named)}
        buckets, reducers = build_shard_buckets(named, [self._names[id(p)] for p in named], group, stage)
        # The probe and the checks above raise before anything changes: now take the parameters over.
        self._schemas = [
            probe_schema(optimizer_class, {**defaults, **_hyper(g)}, g["params"][0]) if g["params"] else None
            for g in self.param_groups
        ]
        self._shards = [Shard(b, master_weights) for b in buckets]
        for shard in self._shards:
            if self._reduce_scattered(shard):  # param.grad stays None: say where the gradient is
                for param in shard.bucket.params:
                    mark_grad_holder(param, shard, "ZeroRedundancyOptimizer(stage=2)", ZERO2_INSTEAD)
        self.optim = self._local_optimizer(defaults)
        for reducer in reducers:
            shards = {
                s.bucket.reducer_bucket: s
                for s in self._shards
                if s.bucket.reducer_bucket is not None and _owned_by(s, reducer)
            }
            reducer.shard_reduction(_ReducerShards(shards, reducer.parameters))
        self._sync_groups(self.optim.param_groups, self.param_groups)
        self._consolidated: dict[str, Any] | None = None
        self._prepared = False  # the pieces' gradients are taken (shard_gradients) for the next step
        self._initialized = True

    def _local_optimizer(self, defaults: dict[str, Any]) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's pieces, one param group per group of ours."""
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        pieces: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for shard in self._shards:
            for piece, tensor in zip(shard.bucket.pieces, shard.tensors):
                pieces[group_of[id(shard.bucket.params[piece.index])]].append(tensor)
        if not any(pieces):  # this rank's ranges are all padding: step a zero-element tensor
            pieces[0].append(torch.zeros(0))
        groups = [{**_hyper(g), "params": ps} for g, ps in zip(self.param_groups, pieces)]
        return self.optimizer_class(groups, **defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise ConfigError(
                "ZeroRedundancyOptimizer: parameters cannot be added after construction (they would need new "
                "buckets); build the optimizer with every param group"
            )
        super().add_param_group(param_group)

    # stepping ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None
        self._sync_groups(self.param_groups, self.optim.param_groups)
        self._prepare_grads()
        self._prepared = False
        # found_inf and grad_scale, set on us for this step: the wrapped fused optimizer's to read
        amp = {k: self.__dict__[k] for k in _AMP_SKIP if k in self.__dict__}
        for key, value in amp.items():
            setattr(self.optim, key, value)
        try:
            self.optim.step()
        finally:
            for key in amp:
                delattr(self.optim, key)
        self._sync_groups(self.optim.param_groups, self.param_groups)
        last = len(self._shards) - 1
        works = [shard.publish(async_op=k != last) for k, shard in enumerate(self._shards)]
        for work in works:
            if work is not None:
                work.wait()
        return loss

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether step() takes the `found_inf` and `grad_scale` attributes that LossScaler.step_on_device and
        torch.amp.GradScaler set on an optimizer for one step (grad_scaler.py, GradScaler.step): when the
        wrapped optimizer does (torch's fused Adam, AdamW, SGD), which then skips its step on the device where
        found_inf is set. The pieces it would have changed stay as they were, so the all-gather after it
        publishes the parameters unchanged (from the master weights, also unchanged)."""
        return bool(getattr(self.__dict__.get("optim"), "_step_supports_amp_scaling", False))

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for shard in self._shards:
            shard.forget_grads()
        self._prepared = False

    @staticmethod
    def _sync_groups(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
        """Copy hyperparameters (e.g. an LR scheduler's lr) from one list of param groups to the other."""
        for src, dst in zip(source, target):
            dst.update(_hyper(src))

    # inspection --------------------------------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: the wrapped optimizer's state tensors and the fp32
        master weights (measured from the tensors)."""
        return optimizer_state_bytes(self.optim) + sum(s.state_bytes() for s in self._shards)

    def grad_holders(self) -> list[torch.Tensor]:
        """The tensors whose `.grad` the next step() reads, for a loss scaler's unscale and overflow check
        (`LossScaler.step(optimizer, optimizer.grad_holders())`): the parameters under ZeRO-1 (full
        averaged gradients), and under ZeRO-2 this rank's pieces of the reduced gradients."""
        holders: list[torch.Tensor] = []
        for shard in self._shards:
            if self._reduce_scattered(shard):
                holders += shard.tensors
            else:
                holders += shard.bucket.params
        return holders

    def shard_gradient_pieces(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, gradient of this rank's piece of it) for every piece the next step() updates: each
        element of the model's gradient is in exactly one DP rank's list. Under ZeRO-1 they are taken from
        the parameters' gradients now, and step() then uses them as they are (e.g. clipped)."""
        self._prepare_grads()
        return [
            (s.bucket.params[piece.index], t.grad)
            for s in self._shards
            for piece, t in zip(s.bucket.pieces, s.tensors)
            if t.grad is not None
        ]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """threadpar.parallel.clip_grad_norm_ for the gradients this optimizer steps: the whole model's
        gradient norm from every rank's shards, which are clipped in place (max_norm=inf measures only).
        A collective over the launch: every rank calls it, after backward and before step()."""
        return clip_shard_grad_norm_(
            self.shard_gradient_pieces(), max_norm, norm_type, error_if_nonfinite, foreach
        )

    def _reduce_scattered(self, shard: Shard) -> bool:
        return self.stage == 2 and shard.bucket.reducer_bucket is not None

    def _prepare_grads(self) -> None:
        if not self._prepared:
            for shard in self._shards:
                if not self._reduce_scattered(shard):  # ZeRO-2's reduced shards already hold theirs
                    shard.grads_from_params()
            self._prepared = True

    # state -------------------------------------------------------------------------------------------------------
    def _schema(self) -> StateSchema:
        schemas = [s for s in self._schemas if s is not None]
        first = schemas[0]
        keys = set().union(*(s.elementwise for s in schemas))
        scalars = {k: d for s in schemas for k, d in s.scalars}
        return StateSchema(tuple(sorted(keys)), tuple(sorted(scalars.items())), first.scalars_on_device)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the dense state now (a collective over every group, on every rank); the next
        state_dict() returns it without communicating. `to` is accepted for torch's signature: with rank
        threads every rank receives the state."""
        self._consolidated = self._dense_state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The state of a plain `optimizer_class` over the same parameters (dense, indexed like this
        optimizer's params), plus a "zero" entry naming the class. A collective over every group unless
        consolidate_state_dict() ran since the last step."""
        if self._consolidated is not None:
            return self._consolidated
        return self._dense_state_dict()

    def _dense_state_dict(self) -> dict[str, Any]:
        dense = gather_dense(self._shards, self.optim.state, self._schema())
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {
            "state": {index[id(p)]: entry for p, entry in dense.items()},
            "param_groups": packed_param_groups(self.param_groups),
            "zero": {"format": STATE_FORMAT, "optimizer_class": _class_name(self.optimizer_class)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dense state (from this class on any dp, or from a plain `optimizer_class`): each rank
        keeps its pieces. Checked on every rank before anything changes."""
        zero = state_dict.get("zero")
        mine = _class_name(self.optimizer_class)
        if zero is not None and zero.get("optimizer_class") != mine:
            raise ConfigError(
                f"ZeroRedundancyOptimizer.load_state_dict: the state was saved by a {zero.get('optimizer_class')} "
                f"optimizer, this one runs {mine}; load it into the class that wrote it"
            )
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved_groups] != sizes:
            raise ConfigError(
                "ZeroRedundancyOptimizer.load_state_dict: the saved param groups hold "
                f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer's hold {sizes}"
            )
        params = {i: p for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        positions = [i for g in saved_groups for i in g["params"]]
        by_saved = dict(zip(positions, range(len(positions))))
        dense = {params[by_saved[i]]: entry for i, entry in state_dict["state"].items()}
        schema = self._schema()
        check_dense(dense, self._names, schema, self.optimizer_class.__name__)
        self._consolidated = None
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(copy.deepcopy(_hyper(saved)))
        self._sync_groups(self.param_groups, self.optim.param_groups)
        self.optim.state = defaultdict(dict, load_dense(self._shards, dense, schema))


_AMP_SKIP = ("found_inf", "grad_scale")  # what GradScaler.step sets on an optimizer that takes them


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _owned_by(shard: Shard, reducer: Any) -> bool:
    ids = {id(p) for p in reducer.parameters}
    return shard.bucket.reducer_bucket is not None and id(shard.bucket.params[0]) in ids


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in `optimizer.state` (this rank's): for a ZeroRedundancyOptimizer (ours or
    torch's) its local optimizer's, plus our fp32 master weights."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_bytes()
    inner = getattr(optimizer, "optim", None)  # torch.distributed.optim.ZeroRedundancyOptimizer
    state = (inner if isinstance(inner, torch.optim.Optimizer) else optimizer).state
    return sum(
        v.numel() * v.element_size()
        for entry in state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
