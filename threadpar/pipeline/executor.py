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

Each microbatch's saved activations are released as soon as its backward has run (for a split backward:
its W). A chunk that has a `no_sync()` method (a DistributedDataParallel wrapper) runs every backward but its
last of the step inside `no_sync()`, so its gradients are synchronized once per step, after the last
microbatch; with a split backward that last one is the chunk's last W (split_backward.py: W accumulates
through the parameters' AccumulateGrad nodes, where the reducer's hooks are).
"""

from __future__ import annotations

import contextlib
import functools
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError, RankAborted
from threadpar.parallel.groups import resolve_group
from threadpar.pipeline.p2p import (
    Link,
    LocalChannel,
    add_note,
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

_CATEGORY = {"F": "forward", "B": "backward", "W": "weight"}  # timeline categories
_DESCRIPTION = {"F": "forward", "B": "backward", "W": "weight gradients"}


@functools.lru_cache(maxsize=32)
def _named_plan(schedule: str, pp: int, n: int, v: int) -> tuple[Plan, Simulation]:
    """A named schedule's plan and its dry run. Both are immutable data, so the stages of a pipeline (threads
    of one process) share one copy instead of each building and checking its own."""
    plan = build_plan(schedule, pp, n, v)
    return plan, simulate(plan)


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


class PipelineParallel:
    """This rank's stage of a pipeline: its chunks, its action list, its links to the neighbouring ranks."""

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
        self.prefetch = bool(prefetch)  # post the next action's receive before the current compute
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.num_microbatches = n
        self.group = resolve_group(group, "PP", who="PipelineParallel")
        self.pp, self.stage = self.group.size(), self.group.rank()
        # The dry run proves the plan cannot deadlock; its unit-cost grid is what a failure report shows.
        self.plan, self.simulation = self._make_plan(schedule, len(chunk_list))
        check_tag_range(self.plan.num_chunks, n)
        self.actions: tuple[Action, ...] = self.plan.actions[self.stage]
        self.is_first_stage = self.plan.rank_of(0) == self.stage
        self.is_last_stage = self.plan.rank_of(self.plan.num_chunks - 1) == self.stage
        self.expected_peak_saved_activations = self.simulation.peak_in_flight[self.stage]
        self.peak_saved_activations = 0  # measured by the last train_step
        self.timeline = Timeline(self.group.global_rank, self.stage)
        self.device = _device_of(chunk_list)
        self.autocast_dtype = _check_autocast(autocast_dtype, self.device)
        # One link per neighbouring stage, and one to this stage itself for a chunk whose neighbour chunk is
        # on this rank (pp = 1, or the bottom of ZB-V's V), which keeps its messages in a local channel.
        ranks = self.group.ranks
        self._links: dict[int, Link] = {
            self.stage: Link(LocalChannel(), ranks[self.stage], self.device, self.timeline)
        }
        for peer in ((self.stage - 1) % self.pp, (self.stage + 1) % self.pp):
            if peer not in self._links:
                self._links[peer] = Link(self.group, ranks[peer], self.device, self.timeline)
        self._from_prev = self._links[(self.stage - 1) % self.pp]  # the links of the loop placement
        self._to_next = self._links[(self.stage + 1) % self.pp]
        self._anchor = gradient_anchor(self.device)
        self._trainable = [[p for p in c.parameters() if p.requires_grad] for c in chunk_list]
        self._check_weight_actions()
        # Gradient sync (DDP chunks): only the last action of each chunk that accumulates weight gradients
        # (a fused backward or a W) runs outside no_sync().
        last_backward = {a.chunk: i for i, a in enumerate(self.actions) if self._accumulates(a)}
        self._sync_indices = frozenset(last_backward.values())
        self._forward_plan: tuple[Plan, Simulation] | None = None
        self._saved: dict[tuple[int, int], torch.Tensor | None] = {}
        self._check_agreement()

    # construction helpers ---------------------------------------------------------------------------------------
    def _make_plan(self, schedule: str | Plan, v: int) -> tuple[Plan, Simulation]:
        if isinstance(schedule, str):
            return _named_plan(schedule, self.pp, self.num_microbatches, v)
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
        return schedule, simulate(schedule)

    def _accumulates(self, action: Action) -> bool:
        """Whether `action` accumulates weight gradients: a W, or a backward that is not split."""
        return action.weight or (not action.forward and action.key not in self.plan.split)

    def _check_weight_actions(self) -> None:
        """W actions need weights: a chunk without trainable parameters has no weight gradient to defer."""
        for local, params in enumerate(self._trainable):
            chunk = local * self.pp + self.stage
            if not params and any(c == chunk for c, _ in self.plan.split):
                raise ConfigError(
                    f"PipelineParallel: schedule {self.plan.name!r} has W actions (weight gradients) for chunk "
                    f"{chunk} on stage {self.stage}, but that chunk has no parameter that requires grad; use "
                    "a schedule without W actions (e.g. '1f1b' or 'interleaved'), or a plan whose backwards "
                    "of that chunk are fused (a B with no W)"
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
        input_mbs = self._split("inputs", inputs) if self.is_first_stage else None
        target_mbs = self._split("targets", targets) if self.is_last_stage else None
        saved: dict[tuple[int, int], torch.Tensor | None] = {}  # (chunk, microbatch) -> backward root
        pending: dict[tuple[int, int], PendingWeights] = {}  # split B's waiting for their W
        self._saved = saved  # for _post_receive: whether a backward will get a gradient message
        losses: list[torch.Tensor] = []
        peak = 0

        def run(index: int, action: Action) -> None:
            nonlocal peak
            if action.weight:
                # W: the weight gradients; then the graph (kept by `saved` until here) is freed.
                self._backward_weight(action, index, pending.pop(action.key))
                del saved[action.key]
            elif not action.forward and action.key in self.plan.split:
                pending[action.key] = self._backward_input(action, saved[action.key])
            elif action.forward:
                output = self._forward(action, input_mbs)
                if action.chunk == self.plan.num_chunks - 1:
                    assert target_mbs is not None  # the last chunk runs on the last stage, which has them
                    loss = self._loss(output, target_mbs[action.microbatch])
                    losses.append(loss.detach())
                    saved[(action.chunk, action.microbatch)] = loss / self.num_microbatches
                else:
                    saved[(action.chunk, action.microbatch)] = send_activation(
                        output,
                        self._link_to_next(action.chunk),
                        chunk=action.chunk,
                        microbatch=action.microbatch,
                    )
                peak = max(peak, len(saved))
            else:
                # pop: the graph (this microbatch's activations) is freed by its backward, right here.
                self._backward(action, index, saved.pop((action.chunk, action.microbatch)))

        with torch.enable_grad():
            self._run(self.actions, self.simulation, run)
        self.peak_saved_activations = peak
        loss = self._share_loss(losses)
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
            self._forward_plan = (plan, simulate(plan))
        plan, simulation = self._forward_plan
        input_mbs = self._split("inputs", inputs) if self.is_first_stage else None
        outputs: list[torch.Tensor] = []

        def run(index: int, action: Action) -> None:
            output = self._forward(action, input_mbs)
            if action.chunk == plan.num_chunks - 1:
                outputs.append(output)
            else:
                send_activation(
                    output, self._link_to_next(action.chunk), chunk=action.chunk, microbatch=action.microbatch
                )

        with torch.no_grad():
            self._run(plan.actions[self.stage], simulation, run)
        return concat_microbatches(outputs) if self.is_last_stage else None

    # the action loop --------------------------------------------------------------------------------------------
    def _run(self, actions: Sequence[Action], simulation: Simulation, run: Callable[[int, Action], None]):
        self.timeline.clear()
        record = self.timeline.record
        for index, action in enumerate(actions):
            t0 = time.perf_counter()
            try:
                if self.prefetch and index + 1 < len(actions):
                    self._post_receive(actions[index + 1])
                run(index, action)
            except RankAborted:
                raise  # a consequence of another rank's failure, reported there
            except Exception as error:
                add_note(error, self._failure_report(simulation, index, action))
                raise
            record(str(action), _CATEGORY[action.kind], t0, time.perf_counter())

    def _link_from_prev(self, chunk: int) -> Link:
        """The link to the rank of chunk - 1 (where chunk's input comes from and its gradient goes)."""
        return self._links[self.plan.rank_of(chunk - 1)]

    def _link_to_next(self, chunk: int) -> Link:
        """The link to the rank of chunk + 1 (where chunk's output goes and its gradient comes from)."""
        return self._links[self.plan.rank_of(chunk + 1)]

    def _post_receive(self, action: Action) -> None:
        """Post the receive `action` will wait for (its input activation, or its output's gradient), so
        that its transfer overlaps the current action's compute (see p2p.Channel)."""
        if action.forward:
            if action.chunk > 0:
                self._link_from_prev(action.chunk).post(
                    message_tag(action.microbatch, action.chunk - 1, False)
                )
        elif (
            not action.weight
            and action.chunk < self.plan.num_chunks - 1
            and self._saved.get(action.key) is not None  # None: no gradient comes back for this output
        ):
            self._link_to_next(action.chunk).post(message_tag(action.microbatch, action.chunk, backward=True))

    def _failure_report(self, simulation: Simulation, index: int, action: Action) -> str:
        grid = simulation.grid(mark=[(self.stage, index)], legend="[x] = the failing action (unit-cost grid)")
        return (
            f"pipeline schedule {simulation.plan.name!r} failed on rank {self.group.global_rank} "
            f"(stage {self.stage}) in action {action} ({_DESCRIPTION[action.kind]} of "
            f"microbatch {action.microbatch} through chunk {action.chunk}), its action #{index}:\n{grid}"
        )

    def _forward(self, action: Action, input_mbs: list | None) -> Any:
        chunk, microbatch = action.chunk, action.microbatch
        if chunk == 0:
            assert input_mbs is not None  # chunk 0 runs on the first stage, which has the inputs
            x = input_mbs[microbatch]
        else:
            x = recv_activation(self._link_from_prev(chunk), self._anchor, chunk=chunk, microbatch=microbatch)
        with self._autocast():
            return call_chunk(self.chunks[action.local_chunk(self.pp)], x)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Forward and loss under torch.autocast when autocast_dtype is set (backward runs outside it, as
        torch's AMP recipe says: autograd replays each op in the dtype its forward used)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _backward(self, action: Action, index: int, root: torch.Tensor | None) -> None:
        with self._sync_guard(self.chunks[action.local_chunk(self.pp)], index):
            if action.chunk == self.plan.num_chunks - 1:
                if root is not None and root.requires_grad:
                    root.backward()
            elif root is not None:
                # The token of this chunk's send: its backward receives dL/d(output) from the next stage
                # (and drops it, for a frozen chunk whose output needs none).
                run_backward(root)
        if action.chunk > 0:  # sends dL/d(input) back, or "none" if this backward never reached the input
            settle_gradient(
                self._link_from_prev(action.chunk), chunk=action.chunk, microbatch=action.microbatch
            )

    def _sync_guard(self, module: nn.Module, index: int) -> contextlib.AbstractContextManager:
        """no_sync() for a DDP chunk, except in the chunk's last gradient-accumulating action of the step."""
        no_sync = getattr(module, "no_sync", None)
        if callable(no_sync) and index not in self._sync_indices:
            return no_sync()
        return contextlib.nullcontext()

    def _backward_input(self, action: Action, root: torch.Tensor | None) -> PendingWeights:
        """B of a split backward: dL/d(input) only, sent upstream at once; returns what its W needs."""
        local = action.local_chunk(self.pp)
        edges: list = []
        grads: list[torch.Tensor] = []
        if root is not None:
            if action.chunk == self.plan.num_chunks - 1:
                edges, grads = loss_gradient(root)
            else:
                edges, grads = receive_output_gradients(root, self._anchor)
        # No weight gradient is accumulated here, so no DDP hook fires; no_sync() only for clarity.
        with self._sync_guard(self.chunks[local], -1):
            weights = backward_input(edges, grads, self._anchor, self._trainable[local])
        if action.chunk > 0:
            settle_gradient(
                self._link_from_prev(action.chunk), chunk=action.chunk, microbatch=action.microbatch
            )
        return weights

    def _backward_weight(self, action: Action, index: int, weights: PendingWeights) -> None:
        """W of a split backward: the weight gradients from what its B kept."""
        local = action.local_chunk(self.pp)
        with self._sync_guard(self.chunks[local], index):
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
