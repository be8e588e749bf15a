"""DistributedDataParallel: one model replica per rank thread, gradients averaged over a group in backward.

    model = DistributedDataParallel(MyModel())      # in every rank; averages over this rank's DP group
    loss_fn(model(x_of_this_rank), y).backward()    # param.grad: the average over the group's ranks
    optimizer.step()

The default group is this rank's DP group (its DP x CP group when the layout has context parallelism):
the ranks holding the same tensor-parallel shards and pipeline stage. So a module whose parameters are TP
shards is wrapped as is; DDP only ever reduces over its group. With a group of one rank DDP does nothing.

MoE experts sharded over an EP group (GroupedExperts with ep > 1) are not replicas: DDP reduces them over
the members of its group that hold the same experts, scaled so that they get the gradient of the same
mean as every other parameter (see experts.py).
"""

from __future__ import annotations

import contextlib
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.comm.torch_signatures import follows
from threadpar.errors import ConfigError
from threadpar.parallel.clip_grad.placement import grad_placements_of
from threadpar.parallel.ddp import torch_options
from threadpar.parallel.ddp.comm_hooks import CommHook
from threadpar.parallel.ddp.experts import experts_group, sharded_experts
from threadpar.parallel.ddp.reducer import Reducer, ReducerOptions
from threadpar.parallel.groups import data_parallel_group, expert_data_parallel_group, resolve_group
from threadpar.parallel.records import ParamRecord
from threadpar.runtime import context
from threadpar.topology import Axis


@dataclass(kw_only=True)
class DDPOptions(ReducerOptions):
    broadcast_buffers: bool = True  # at every forward, copy the group's first rank's buffers to the others

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.broadcast_buffers, bool):
            raise ConfigError(f"broadcast_buffers must be True or False, got {self.broadcast_buffers!r}")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: ProcessGroup, src: int) -> None:
    """Overwrite `tensors` with rank `src`'s values: one broadcast per (device, dtype), not per tensor.

    Writes go through `.data`, which leaves autograd's version counters alone: BatchNorm saves its running
    stats for backward, and a pipeline runs the next forward (and this broadcast) before that backward.
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.device, t.dtype)].append(t)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
            group.broadcast(flat, src=src)
            if group.global_rank != src:
                for t, piece in zip(same_kind, flat.split([t.numel() for t in same_kind])):
                    t.data.copy_(piece.view_as(t))


def _sync_at_init(module: nn.Module, group: ProcessGroup, src: int, expert_ids: set[int]) -> None:
    """torch's init_sync: check every rank wrapped the same structure, then copy `src`'s parameters (all but
    the sharded experts') and buffers to the others."""
    _check_same_structure(module, group)
    broadcast_coalesced(
        [*(p for p in module.parameters() if id(p) not in expert_ids), *module.buffers()], group, src
    )


def _check_same_structure(module: nn.Module, group: ProcessGroup) -> None:
    """Fail clearly, at wrap time, if the ranks of the group wrapped modules of different shapes."""
    described = [f"{name}:{list(t.shape)}:{t.dtype}" for name, t in module.state_dict(keep_vars=True).items()]
    fingerprint = zlib.crc32("\n".join(described).encode())
    device = next(module.parameters()).device
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    everyone = torch.empty(group.size(), dtype=torch.int64, device=device)
    group.all_gather_into_tensor(everyone, mine)
    differ = [group.ranks[m] for m, f in enumerate(everyone.tolist()) if f != fingerprint]
    if differ:
        raise ConfigError(
            f"DistributedDataParallel: rank {group.global_rank} and ranks {differ} of group '{group.name}' "
            "wrapped modules with different parameters or buffers (names, shapes or dtypes); every rank of "
            f"the group must wrap the same architecture. This rank has: {', '.join(described[:8])}"
            + (" ..." if len(described) > 8 else "")
        )


class DistributedDataParallel(nn.Module):
    """Data parallelism between rank threads; see the module docstring.

    The parameters are the installed torch's DistributedDataParallel's, in torch's order (2.12 has no
    forward_sync_buffers and defaults broadcast_buffers to True: comm/torch_signatures.py,
    tests/test_torch_signatures.py); threadpar's own come after them, keyword-only. device_ids=[i] (the tutorial's line) is accepted on a CUDA
    rank whose device is cuda:i, and then forward moves tensor inputs there, as torch does; a CPU module
    takes device_ids=None, as in torch (torch_options.py). init_sync=False skips the check that every rank
    wrapped the same structure and the first copy of rank 0's parameters and buffers.
    bucket_cap_mb / first_bucket_cap_mb: bucket sizes in MiB (the first bucket is small so communication
    starts early in backward). gradient_as_bucket_view: param.grad is a view into its bucket's flat buffer,
    which comm hooks using bucket.buffer() (compression) then read without a copy; zero grads with
    set_to_none=False to keep the views (else each backward copies the new grads in). Without it the
    gradients stay where autograd put them and the default hook averages them in place, copying nothing.
    broadcast_buffers: copy the first rank's buffers (e.g. BatchNorm running stats) to the others at every
    forward. find_unused_parameters: allow parameters that get no gradient on some ranks or iterations.
    gradient_bucketing=False: one all-reduce per parameter (for comparison and debugging).
    expert_process_group: where the gradients of MoE experts sharded over an EP group are reduced; None
    derives it from the groups, with no collective (the launch's EDP group for its EP groups; for an EP
    group carved out of process_group, the members at this rank's place in it: parallel/groups.py).

    Overlap needs a spare core (or a GPU): on CPU ranks that already use every core, all-reducing during
    backward only time-shares the cores, and one bucket (a large bucket_cap_mb and first_bucket_cap_mb)
    was about 5% faster in benchmarks/ddp.py on 2 cores.
    """

    @follows(torch.nn.parallel.DistributedDataParallel.__init__, method=True)
    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: ProcessGroup | Axis | str | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        expert_process_group: ProcessGroup | str | None = None,
        first_bucket_cap_mb: float = 1.0,
        gradient_bucketing: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        torch_options.check_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list,
            check_reduction=check_reduction,
            static_graph=static_graph,
            batched_grad_copy=batched_grad_copy,
            init_sync=init_sync,
        )
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ConfigError(f"DistributedDataParallel: dim must be an int, got {dim!r}")
        rank_device = context.current().device if context.in_rank() else torch.device("cpu")
        self.device_ids: list[int] | None = None
        self._input_device = torch_options.resolve_device_ids(module, device_ids, output_device, rank_device)
        if self._input_device is not None:
            self.device_ids = [self._input_device.index]
        self.output_device = None if self.device_ids is None else self.device_ids[0]
        self.dim = dim
        self.static_graph = static_graph
        if broadcast_buffers is None:  # torch 2.13+: None is True, and forward_sync_buffers overrides it
            broadcast_buffers = True
        if forward_sync_buffers is not None:
            broadcast_buffers = forward_sync_buffers
        self.options = DDPOptions(
            bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            gradient_bucketing=gradient_bucketing,
        )
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError(
                "DistributedDataParallel needs a module with at least one parameter that requires grad; "
                "a module without any has no gradients to average"
            )
        self.module = module
        self.process_group = (
            data_parallel_group() if process_group is None else resolve_group(process_group, "DP")
        )
        group = self.process_group
        self._src = group.ranks[0]
        self._buffers_to_sync = list(module.buffers()) if broadcast_buffers and group.size() > 1 else []
        self._require_sync = True  # used when there is no reducer (a group of one rank)
        experts = sharded_experts(module)
        expert_ids = {id(p) for e in experts for p in e.parameters()}
        replicated = [(name, p) for name, p in named if id(p) not in expert_ids]
        sharded = [(name, p) for name, p in named if id(p) in expert_ids]
        self.expert_process_group: ProcessGroup | None = None
        if experts:
            self.expert_process_group = (
                expert_data_parallel_group(experts_group(experts), group)
                if expert_process_group is None
                else resolve_group(expert_process_group, "DP")
            )
        abort = context.current().world.abort if context.in_rank() else None
        self.reducer: Reducer | None = None
        self.expert_reducer: Reducer | None = None  # the sharded experts' (their own group and scale)
        if group.size() > 1:
            if init_sync:
                _sync_at_init(module, group, self._src, expert_ids)
            if replicated:
                self.reducer = self._reducer(replicated, group, abort)
        if sharded:
            expert_group = self.expert_process_group
            assert expert_group is not None  # sharded parameters are experts'
            if init_sync:
                broadcast_coalesced([p for _, p in sharded], expert_group, expert_group.ranks[0])
            self.expert_reducer = self._reducer(
                sharded, expert_group, abort, expert_group.size() / group.size()
            )
        self.param_records = self._record(module, expert_ids)

    def _record(self, module: nn.Module, expert_ids: set[int]) -> dict[str, ParamRecord]:
        """This wrapper's record of every parameter it holds (frozen ones included): the group its gradient
        is averaged over and the reducer whose buckets do it (for the distributed optimizer), and where
        the reduced gradient sits in the whole model's gradient (for clip_grad_norm_). Also entered in
        the rank's table (threadpar.parallel.records), through which ZeRO and clipping find them."""
        placed = grad_placements_of(module, self.process_group, self.expert_process_group, strict=False)
        table = context.current().params
        records: dict[str, ParamRecord] = {}
        for where, sub, name, placement in placed:
            param = sub._parameters[name]
            expert = id(param) in expert_ids
            group = self.expert_process_group if expert else self.process_group
            assert group is not None  # sharded experts have their expert-DP group
            record = ParamRecord.of_ddp(placement, group, self.expert_reducer if expert else self.reducer)
            records[where] = record
            table.add(sub, name, record)
        return records

    def _reducer(self, named: list, group: ProcessGroup, abort, scale: float = 1.0) -> Reducer:
        return Reducer([p for _, p in named], [n for n, _ in named], group, self.options, abort, scale)

    @property
    def _reducers(self) -> list[Reducer]:
        return [r for r in (self.reducer, self.expert_reducer) if r is not None]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        for reducer in self._reducers:
            reducer.settle_interrupted_backward()
        if self._buffers_to_sync:
            broadcast_coalesced(self._buffers_to_sync, self.process_group, self._src)
        if self._input_device is not None:
            inputs, kwargs = torch_options.move_inputs(self._input_device, inputs, kwargs)
        return self.module(*inputs, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward averages gradients (read when that backward starts)."""
        reducers = self._reducers
        return reducers[0].require_backward_grad_sync if reducers else self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        for reducer in self._reducers:
            reducer.require_backward_grad_sync = bool(value)
        self._require_sync = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards run inside accumulate gradients locally; the first backward outside averages the sum.

        What counts is where the backward runs, not the forward: forwards of several micro-batches may come
        first and their backwards later, all but the last inside no_sync().
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` (see comm_hooks); once, before
        the first backward. state=None passes this module's process group (what built-in hooks expect),
        and the expert-DP group for the buckets of sharded MoE experts."""
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        if self.expert_reducer is not None and state is not None:
            assert self.expert_process_group is not None  # the expert reducer reduces over it
            raise ConfigError(
                "register_comm_hook: this module has MoE experts reduced over their own group "
                f"'{self.expert_process_group.name}', which a state for process group '{self.process_group.name}' "
                "would not reach; register with state=None (each bucket's hook then gets its group)"
            )
        for reducer in self._reducers:
            reducer.register_comm_hook(state, hook)
