"""`PipelineParallel`: run this rank's actions of a pipeline schedule over the PP group.

Every rank of the pipeline builds one with its own chunks (the modules of the global chunks
stage, stage + pp, ...) and calls `train_step` with the same arguments, SPMD style:

    chunks = build_chunks(layers, pp_size=pp, pp_rank=stage, chunks_per_stage=v, first=embed, last=head)
    pipe = PipelineParallel(chunks, loss_fn=F.cross_entropy, schedule="interleaved", num_microbatches=8)
    loss = pipe.train_step(inputs, targets)  # inputs used on the first stage, targets on the last

What travels between chunks: a tensor, or tensors and None/bool/int/float/str constants nested in tuples,
lists and dicts (str keys). The next chunk gets a tuple or list as positional arguments (as
torch.distributed.pipelining does) and a dict as keyword arguments; nested containers arrive as they were
sent. Only floating-point tensors that require grad carry a gradient back (integer masks, token ids and
detached tensors do not), and a chunk may leave any of them unused. The first stage's inputs and the last
stage's targets may be such structures too: every tensor in them is split along dim 0, and `loss_fn` gets
the last chunk's output as it returned it.

Mixed precision: `autocast_dtype=torch.bfloat16` (or float16) runs every chunk's forward and the loss under
torch.autocast on the rank's device type (InfiniTrain's TrainStep(..., dtype)); parameters, gradients and
the optimizer stay in their own dtype (fp32 master weights), and activations travel between stages in the
dtype autocast gave them. With float16, scale the loss (threadpar.parallel.LossScaler).

The executor is a plain interpreter of the lowered plan (lowering.py): the schedule's compute actions plus
the messages and gradient synchronizations that lowering makes explicit. Per action: RECV_F / RECV_B post
a receive (the compute action that consumes it waits for it); F runs the chunk (and the loss, on the last
chunk); SEND_F posts the output to the next chunk's rank; B runs the full backward, I the input gradient
only and W the weight gradients from what I kept (split_backward.py); SEND_B answers the previous chunk's
rank (autograd hands dL/d(input) to the link the moment it reaches the input, so that send overlaps the
rest of the backward; SEND_B sends an empty "no gradient" answer when it never reached it); SYNC_GRAD
makes the chunk's next gradient-accumulating action synchronize its gradients: a chunk that has a
`no_sync()` method (a DistributedDataParallel wrapper) runs every other B and W inside `no_sync()`, so its
gradients are synchronized once per step, overlapping its last backward (for a split one its last W: W
accumulates through the parameters' AccumulateGrad nodes, where the reducer's hooks are). Each
microbatch's saved activations are released as soon as its backward has run (for a split backward: its W).
"""

from __future__ import annotations

import contextlib
import functools
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError, RankAborted, add_note
from threadpar.parallel.groups import resolve_group
from threadpar.pipeline.lowering import lower
from threadpar.pipeline.message_order import Message, launch_orders
from threadpar.pipeline.p2p import (
    Link,
    LocalChannel,
    check_tag_range,
    gradient_anchor,
    message_tag,
    recv_activation,
    run_backward,
    send_activation,
    settle_gradient,
)
from threadpar.pipeline.schedule import Action, Plan, build_plan
from threadpar.pipeline.simulator import Simulation, simulate
from threadpar.pipeline.split_backward import (
    PendingWeights,
    backward_input,
    backward_weight,
    loss_gradient,
    receive_output_gradients,
)
from threadpar.pipeline.structure import call_chunk, concat_microbatches, split_microbatches
from threadpar.pipeline.timeline import Timeline
from threadpar.pipeline.transport import Transport

# Timeline categories of the compute actions (messages are recorded by their links as send/recv events).
_CATEGORY = {"F": "forward", "B": "backward", "I": "backward", "W": "weight"}
_DESCRIPTION = {
    "F": "forward",
    "B": "backward",
    "I": "input gradient",
    "W": "weight gradients",
    "SEND_F": "send of the output",
    "RECV_F": "receive of the input",
    "SEND_B": "send of the input gradient",
    "RECV_B": "receive of the output gradient",
    "SYNC_GRAD": "gradient synchronization",
}


@functools.lru_cache(maxsize=32)
def _named_plan(schedule: str, pp: int, n: int, v: int, prefetch: bool) -> tuple[Plan, Plan, Simulation]:
    """A named schedule's plan, its lowered form and its dry run. All are immutable data, so the stages of a
    pipeline (threads of one process) share one copy instead of each building and checking its own."""
    plan = build_plan(schedule, pp, n, v)
    return plan, lower(plan, prefetch=prefetch), simulate(plan)


AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _check_autocast(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype not in AUTOCAST_DTYPES:
        raise ConfigError(
            f"PipelineParallel: autocast_dtype={dtype!r}; pass torch.bfloat16 or torch.float16 (None: no autocast)"
        )
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"PipelineParallel: torch.autocast is not available on {device.type} devices")
    return dtype


def _device_of(chunks: Sequence[nn.Module]) -> torch.device:
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


@dataclass(eq=False)
class _Step:
    """What one step's interpreter keeps between actions."""

    inputs: list | None = None  # the first stage's microbatches
    targets: list | None = None  # the last stage's
    evaluate: bool = False  # eval_step: forwards only, no autograd
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # F's output until its SEND_F
    saved: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)  # backward roots
    pending: dict[tuple[int, int], PendingWeights] = field(default_factory=dict)  # I's waiting for their W
    sync: set[int] = field(default_factory=set)  # chunks whose next B or W synchronizes gradients
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs_of_last_chunk: list[Any] = field(default_factory=list)  # eval_step's result
    peak: int = 0  # the most microbatches saved at once


class PipelineParallel:
    """This rank's stage of a pipeline: its chunks, its lowered actions, its links to the neighbouring ranks."""

    def __init__(
        self,
        chunks: nn.Module | Sequence[nn.Module],
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        schedule: str | Plan = "1f1b",
        num_microbatches: int,
        group: ProcessGroup | str | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        autocast_dtype: torch.dtype | None = None,
        prefetch: bool = True,
    ) -> None:
        chunk_list = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        if not chunk_list or not all(isinstance(c, nn.Module) for c in chunk_list):
            raise TypeError("PipelineParallel: chunks must be an nn.Module or a non-empty list of nn.Modules")
        if not callable(loss_fn):
            raise TypeError(f"PipelineParallel: loss_fn must be callable, got {type(loss_fn).__name__}")
        if optimizer is not None and not (hasattr(optimizer, "step") and hasattr(optimizer, "zero_grad")):
            raise TypeError("PipelineParallel: optimizer must have step() and zero_grad()")
        n = num_microbatches
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"PipelineParallel: num_microbatches must be a positive int, got {n!r}")
        self.chunks = chunk_list
        self.prefetch = bool(prefetch)  # lower each receive one compute action ahead of its consumer
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.num_microbatches = n
        self.group = resolve_group(group, "PP", who="PipelineParallel")
        self.pp, self.stage = self.group.size(), self.group.rank()
        # The compute plan, the lowered plan this rank runs, and the dry run that proves the plan cannot
        # deadlock (its unit-cost grid is what a failure report shows).
        self.plan, self.lowered, self.simulation = self._make_plan(schedule, len(chunk_list))
        check_tag_range(self.plan.num_chunks, n)
        self.actions: tuple[Action, ...] = self.lowered.actions[self.stage]
        self.is_first_stage = self.plan.rank_of(0) == self.stage
        self.is_last_stage = self.plan.rank_of(self.plan.num_chunks - 1) == self.stage
        self.expected_peak_saved_activations = self.simulation.peak_in_flight[self.stage]
        self.peak_saved_activations = 0  # measured by the last train_step
        self.timeline = Timeline(self.group.global_rank, self.stage)
        self.device = _device_of(chunk_list)
        self.autocast_dtype = _check_autocast(autocast_dtype, self.device)
        # One link per neighbouring stage, and one to this stage itself for a chunk whose neighbour chunk is
        # on this rank (pp = 1, or the bottom of ZB-V's V), which keeps its messages in a local channel.
        # On a stream-ordered group (nccl) the messages to other stages go over the group's own communicator in
        # a launch order that cannot deadlock there (transport.py); elsewhere through the group's buffered
        # send/recv.
        ranks = self.group.ranks
        self._transport = (
            Transport(self.group, self.device) if self.group.stream_ordered and self.pp > 1 else None
        )
        self._orders: dict[str, tuple[Message, ...]] = {}
        channel: Any = self.group if self._transport is None else self._transport
        self._links: dict[int, Link] = {
            self.stage: Link(LocalChannel(), ranks[self.stage], self.device, self.timeline)
        }
        for peer in ((self.stage - 1) % self.pp, (self.stage + 1) % self.pp):
            if peer not in self._links:
                self._links[peer] = Link(channel, ranks[peer], self.device, self.timeline)
        self._from_prev = self._links[(self.stage - 1) % self.pp]  # the links of the loop placement
        self._to_next = self._links[(self.stage + 1) % self.pp]
        self._anchor = gradient_anchor(self.device)
        self._trainable = [[p for p in c.parameters() if p.requires_grad] for c in chunk_list]
        self._check_weight_actions()
        self._forward_plan: tuple[Plan, Simulation] | None = None
        self._check_agreement()
        if self._transport is not None:
            orders = launch_orders(self.plan)
            self._orders["train"] = orders[self.stage]
            self._transport.connect(orders)  # (the forward plan's pairs are among these)

    # construction helpers ---------------------------------------------------------------------------------------
    def _make_plan(self, schedule: str | Plan, v: int) -> tuple[Plan, Plan, Simulation]:
        if isinstance(schedule, str):
            return _named_plan(schedule, self.pp, self.num_microbatches, v, self.prefetch)
        if not isinstance(schedule, Plan):
            raise TypeError(
                f"PipelineParallel: schedule must be a name ('afab', '1f1b', 'interleaved') or a Plan, "
                f"got {type(schedule).__name__}"
            )
        wanted = {"pp": self.pp, "n": self.num_microbatches, "v": v}
        got = {"pp": schedule.pp, "n": schedule.n, "v": schedule.v}
        if got != wanted or schedule.forward_only:
            raise ConfigError(
                f"PipelineParallel: the plan {schedule.name!r} is for {got} (forward only: "
                f"{schedule.forward_only}), but this pipeline has pp={self.pp} ranks, num_microbatches="
                f"{self.num_microbatches} and {v} chunks on this rank; pass a training plan of those sizes"
            )
        plan = schedule.compute_plan()  # a lowered plan runs as written
        return plan, lower(schedule, prefetch=self.prefetch), simulate(plan)

    def _check_weight_actions(self) -> None:
        """W actions need weights: a chunk without trainable parameters has no weight gradient to defer."""
        for local, params in enumerate(self._trainable):
            chunk = local * self.pp + self.stage
            if not params and any(c == chunk for c, _ in self.plan.split):
                raise ConfigError(
                    f"PipelineParallel: schedule {self.plan.name!r} has W actions (weight gradients) for chunk "
                    f"{chunk} on stage {self.stage}, but that chunk has no parameter that requires grad; use "
                    "a schedule without W actions (e.g. '1f1b' or 'interleaved'), or a plan whose backwards "
                    "of that chunk are full ones (B, no I and W)"
                )

    def _check_agreement(self) -> None:
        """Every stage must run the same plan with the same chunk count: check once, instead of hanging."""
        if self.pp == 1:
            return
        facts = [len(self.chunks), self.num_microbatches, zlib.crc32(str(self.plan).encode())]
        mine = torch.tensor(facts, dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.pp * 3, dtype=torch.int64, device=self.device)
        self.group.all_gather_into_tensor(everyone, mine)
        rows = everyone.view(self.pp, 3).tolist()
        if any(row != rows[0] for row in rows):
            table = ", ".join(f"stage {s}: {c} chunks, n={n}" for s, (c, n, _) in enumerate(rows))
            raise ConfigError(
                f"PipelineParallel: the stages of group '{self.group.name}' disagree ({table}; plans "
                f"{'equal' if len({r[2] for r in rows}) == 1 else 'differ'}); every stage must pass the "
                "same schedule, num_microbatches and number of chunks"
            )

    # public API -------------------------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of this rank's chunks (what its optimizer updates)."""
        for chunk in self.chunks:
            yield from chunk.parameters()

    def train_step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """One step: forward and backward of every microbatch in schedule order, gradients accumulated
        (each microbatch loss scaled by 1/n). Returns the mean loss (0-dim float32) on every stage.

        `inputs` (used on the first stage) and `targets` (on the last): a tensor, or a tuple/list/dict of
        them, each split into num_microbatches along dim 0; constants in them go to every microbatch."""
        step = _Step(
            inputs=self._split("inputs", inputs) if self.is_first_stage else None,
            targets=self._split("targets", targets) if self.is_last_stage else None,
        )
        with torch.enable_grad():
            self._run(self.actions, self.simulation, step, "train")
        self.peak_saved_activations = step.peak
        loss = self._share_loss(step.losses)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss

    def eval_step(self, inputs: Any = None) -> Any:
        """Forward only, without autograd: the model's output for the whole batch on the last stage (the
        microbatch outputs concatenated along dim 0), None on the other stages. For a structured output,
        each tensor is concatenated (a 0-dim one, e.g. an aux loss, stacked into [n]) and each constant
        becomes the list of its n values."""
        if self._forward_plan is None:
            plan = self.plan.forward_plan()
            self._forward_plan = (lower(plan, prefetch=self.prefetch), simulate(plan))
            if self._transport is not None:
                self._orders["eval"] = launch_orders(plan)[self.stage]
        lowered, simulation = self._forward_plan
        step = _Step(inputs=self._split("inputs", inputs) if self.is_first_stage else None, evaluate=True)
        with torch.no_grad():
            self._run(lowered.actions[self.stage], simulation, step, "eval")
        return concat_microbatches(step.outputs_of_last_chunk) if self.is_last_stage else None

    # the interpreter --------------------------------------------------------------------------------------------
    def _run(self, actions: Sequence[Action], simulation: Simulation, step: _Step, kind: str) -> None:
        self.timeline.clear()
        record = self.timeline.record
        compute_index = -1  # the index of the action in the compute plan (what the failure report marks)
        transport = self._transport
        if transport is not None:
            transport.start(kind, self._orders[kind])
        for action in actions:
            compute_index += action.is_compute
            t0 = time.perf_counter()
            try:
                self._execute(action, step)
            except RankAborted:
                raise  # a consequence of another rank's failure, reported there
            except Exception as error:
                add_note(error, self._failure_report(simulation, max(compute_index, 0), action))
                raise
            if action.is_compute:
                record(str(action), _CATEGORY[action.kind], t0, time.perf_counter())
        if transport is not None:
            transport.finish()

    def _execute(self, action: Action, step: _Step) -> None:
        """Run one action of the lowered plan."""
        kind, key = action.kind, action.key
        chunk, microbatch = key
        if kind == "RECV_F":
            self._link_from_prev(chunk).post(message_tag(microbatch, chunk - 1, backward=False))
        elif kind == "RECV_B":
            if step.saved.get(key) is not None:  # None: this output carries no gradient back
                self._link_to_next(chunk).post(message_tag(microbatch, chunk, backward=True))
        elif kind == "F":
            self._forward(action, step)
        elif kind == "SEND_F":
            link = self._link_to_next(chunk)
            token = send_activation(step.outputs.pop(key), link, chunk=chunk, microbatch=microbatch)
            if not step.evaluate:
                step.saved[key] = token
                if token is None:  # no gradient comes back for this output
                    link.skip(message_tag(microbatch, chunk, backward=True), send=False)
        elif kind == "B":
            # pop: the graph (this microbatch's activations) is freed by its backward, right here.
            self._backward(action, step.saved.pop(key), step)
        elif kind == "I":
            step.pending[key] = self._backward_input(action, step.saved[key])
        elif kind == "W":
            # The weight gradients; then the graph (kept by `saved` until here) is freed.
            self._backward_weight(action, step.pending.pop(key), step)
            del step.saved[key]
        elif kind == "SEND_B":  # the gradient went as autograd reached the input; or none reached it
            settle_gradient(self._link_from_prev(chunk), chunk=chunk, microbatch=microbatch)
        elif kind == "SYNC_GRAD":
            step.sync.add(chunk)
        else:  # Action rejects unknown kinds; a new kind must be taught here
            raise ConfigError(f"PipelineParallel cannot run action {action}: no rule for kind {kind!r}")

    def _link_from_prev(self, chunk: int) -> Link:
        """The link to the rank of chunk - 1 (where chunk's input comes from and its gradient goes)."""
        return self._links[self.plan.rank_of(chunk - 1)]

    def _link_to_next(self, chunk: int) -> Link:
        """The link to the rank of chunk + 1 (where chunk's output goes and its gradient comes from)."""
        return self._links[self.plan.rank_of(chunk + 1)]

    def _failure_report(self, simulation: Simulation, index: int, action: Action) -> str:
        grid = simulation.grid(mark=[(self.stage, index)], legend="[x] = the failing action (unit-cost grid)")
        what = f"({_DESCRIPTION[action.kind]} of microbatch {action.microbatch} through chunk {action.chunk})"
        if not action.is_compute:
            what = f"({_DESCRIPTION[action.kind]} of chunk {action.chunk}" + (
                f", microbatch {action.microbatch})" if action.kind != "SYNC_GRAD" else ")"
            )
        return (
            f"pipeline schedule {simulation.plan.name!r} failed on rank {self.group.global_rank} "
            f"(stage {self.stage}) in action {action} {what}, at compute action #{index}:\n{grid}"
        )

    def _forward(self, action: Action, step: _Step) -> None:
        chunk, microbatch = action.key
        if chunk == 0:
            assert step.inputs is not None  # chunk 0 runs on the first stage, which has the inputs
            x = step.inputs[microbatch]
        else:
            anchor = None if step.evaluate else self._anchor
            link = self._link_from_prev(chunk)
            x = recv_activation(link, anchor, chunk=chunk, microbatch=microbatch)
            gradient = message_tag(microbatch, chunk - 1, backward=True)
            if not step.evaluate and not link.owes(gradient):  # the input carries no gradient back
                link.skip(gradient, send=True)
        with self._autocast():
            output = call_chunk(self.chunks[action.local_chunk(self.pp)], x)
        if chunk < self.plan.num_chunks - 1:
            step.outputs[action.key] = output  # for SEND_F
        elif step.evaluate:
            step.outputs_of_last_chunk.append(output)
        else:
            assert step.targets is not None  # the last chunk runs on the last stage, which has them
            loss = self._loss(output, step.targets[microbatch])
            step.losses.append(loss.detach())
            step.saved[action.key] = loss / self.num_microbatches
        step.peak = max(step.peak, len(step.saved) + len(step.outputs))

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Forward and loss under torch.autocast when autocast_dtype is set (backward runs outside it, as
        torch's AMP recipe says: autograd replays each op in the dtype its forward used)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _backward(self, action: Action, root: torch.Tensor | None, step: _Step) -> None:
        with self._sync_guard(action, step):
            if action.chunk == self.plan.num_chunks - 1:
                if root is not None and root.requires_grad:
                    root.backward()
            elif root is not None:
                # The token of this chunk's send: its backward receives dL/d(output) from the next stage
                # (and drops it, for a frozen chunk whose output needs none).
                run_backward(root)

    def _sync_guard(self, action: Action, step: _Step) -> contextlib.AbstractContextManager:
        """no_sync() for a DDP chunk, unless a SYNC_GRAD of its chunk came before this action (then this
        action's backward synchronizes the gradients, once)."""
        no_sync = getattr(self.chunks[action.local_chunk(self.pp)], "no_sync", None)
        if action.chunk in step.sync and action.accumulates:
            step.sync.discard(action.chunk)
            return contextlib.nullcontext()
        return no_sync() if callable(no_sync) else contextlib.nullcontext()

    def _backward_input(self, action: Action, root: torch.Tensor | None) -> PendingWeights:
        """I: dL/d(input) only (handed to the link for SEND_B as soon as it is computed); returns what its W
        needs."""
        local = action.local_chunk(self.pp)
        edges: list = []
        grads: list[torch.Tensor] = []
        if root is not None:
            if action.chunk == self.plan.num_chunks - 1:
                edges, grads = loss_gradient(root)
            else:
                edges, grads = receive_output_gradients(root, self._anchor)
        # No weight gradient is accumulated here, so no DDP hook fires; no_sync() only for clarity.
        no_sync = getattr(self.chunks[local], "no_sync", None)
        with no_sync() if callable(no_sync) else contextlib.nullcontext():
            return backward_input(edges, grads, self._anchor, self._trainable[local])

    def _backward_weight(self, action: Action, weights: PendingWeights, step: _Step) -> None:
        """W of a split backward: the weight gradients from what its I kept."""
        with self._sync_guard(action, step):
            backward_weight(weights)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        with self._autocast():
            loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"PipelineParallel: loss_fn must return a scalar tensor (a mean over the microbatch), got "
                f"{type(loss).__name__}{list(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
            )
        return loss.reshape(())

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean microbatch loss, computed on the last stage and broadcast to every stage."""
        mean = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last_stage:
            mean = torch.stack(losses).to(torch.float64).mean()
        if self.pp > 1:
            self.group.broadcast(mean, src=self.group.ranks[self.plan.rank_of(self.plan.num_chunks - 1)])
        return mean.to(torch.float32)

    def _split(self, what: str, batch: Any) -> list:
        return split_microbatches(batch, self.num_microbatches, what)

    def __repr__(self) -> str:
        return (
            f"PipelineParallel(stage {self.stage} of {self.pp}, {len(self.chunks)} chunks, "
            f"schedule {self.plan.name!r}, {self.num_microbatches} microbatches)"
        )
