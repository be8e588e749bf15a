"""The demo's training loop, run by every rank thread, and the state it shares with the caller.

`RunState` is created by the caller and handed to every rank: the dense weights and data go in, the
losses, timings, timelines, memory peaks and checkpoint parts come back, all in host memory. Under torchrun
each process has its own, filled by its own ranks; process 0 then gathers the others' per-rank entries
(threadpar.demo.process_exchange).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from threadpar.checkpoint import load_optimizer_state
from threadpar.comm import get_group, get_rank
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.cuda_graphs import graphed_step, graphs_here
from threadpar.demo.cli import DemoConfig
from threadpar.demo.data import Batches, data_parallel_slice
from threadpar.demo.memory import SavedActivationTracker, device_peak_bytes
from threadpar.demo.report import ProgressBar
from threadpar.models.gpt import GPTConfig
from threadpar.models.parallelize_gpt import HybridGPT, parallelize_gpt
from threadpar.parallel import LossScaler, clip_grad_norm_, grad_placements, total_grad_norm
from threadpar.parallel.zero import ZeroRedundancyOptimizer, optimizer_state_bytes
from threadpar.pipeline import Timeline
from threadpar.runtime.context import get_coords, get_device, get_layout

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(
    params, lr: float, zero: int = 0, capturable: bool = False, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW; with zero=1 or 2 a ZeroRedundancyOptimizer around it, sharded over each parameter's DDP group
    (over the DP group of one rank when dp x cp = 1: parallelize_gpt wraps no DDP then). `capturable`:
    its step keeps its counts on the device (a CUDA graph can hold it). `fused`: torch's fused AdamW, which
    skips its step on the device on an fp16 overflow (LossScaler.optimizer_step_on_device)."""
    options: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.0, "capturable": capturable}
    if fused:
        options["fused"] = True
    if not zero:
        return torch.optim.AdamW(params, **options)
    layout = get_layout()
    group = None if layout.dp * layout.cp > 1 else "DP"
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, stage=zero, process_group=group, **options)


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: list, scaler: LossScaler | None, max_norm: float
) -> float | None:
    """Unscale (fp16), clip the whole model's gradient to max_norm (0: measure it only), step. Returns the
    gradient norm before clipping, the same on every rank; None when an fp16 overflow skipped the step."""
    zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    # The scaler reads and writes `.grad` only: ZeRO-2's pieces are plain tensors holding the reduced shards.
    holders = params if zero is None else cast(list[torch.nn.Parameter], zero.grad_holders())
    overflow = scaler is not None and scaler.unscale_and_check(holders)
    norm = None
    if not overflow:  # the same branch on every rank: the overflow flag is agreed over the world
        if zero is not None:  # the norm over its shards, which it clips (ZeRO-2 keeps no param.grad)
            norm = float(zero.clip_grad_norm_(max_norm if max_norm > 0 else math.inf))
        elif max_norm > 0:
            norm = float(clip_grad_norm_(params, max_norm))
        else:
            with_grad = [p for p in params if p.grad is not None]
            norm = float(total_grad_norm([p.grad for p in with_grad], grad_placements(with_grad)))
        optimizer.step()
    if scaler is not None:
        scaler.update(overflow)
    return norm


def device_step(
    model: HybridGPT,
    optimizer: torch.optim.Optimizer,
    params: list,
    max_norm: float,
    scaler: LossScaler | None = None,
):
    """The step of --cuda-graphs, device work only: clip_and_step's unscaling (fp16), clipping and step with
    the norm and the overflow flag kept tensors (an overflow skips the step on the device: the fused AdamW
    reads the flag), the gradients zeroed in place (a graph's memory is static). Returns (the replica losses
    averaged over DP and the MoE aux part, the gradient norm before clipping, the agreed overflow flag: 1.0
    where an fp16 step was skipped)."""
    zero = optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None
    dp_group = get_group("DP")
    holders = params if zero is None else cast(list[torch.nn.Parameter], zero.grad_holders())

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = model.train_step(inputs, targets)
        # (on an overflow the clipping below sees inf or nan: harmless, the step that would use it is skipped)
        found_inf = (
            scaler.unscale_on_device(holders)
            if scaler is not None
            else loss.new_zeros((), dtype=torch.float32)
        )
        if zero is not None:
            norm = zero.clip_grad_norm_(max_norm if max_norm > 0 else math.inf)
        elif max_norm > 0:
            norm = clip_grad_norm_(params, max_norm)
        else:
            with_grad = [p for p in params if p.grad is not None]
            norm = total_grad_norm([p.grad for p in with_grad], grad_placements(with_grad))
        if scaler is not None:
            scaler.optimizer_step_on_device(optimizer, found_inf)
            scaler.update(found_inf)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        assert model.last_aux is not None  # (train_step set it)
        loss_and_aux = torch.stack([loss.detach(), model.last_aux])
        dp_group.all_reduce(loss_and_aux, op=ReduceOp.AVG)
        return loss_and_aux, norm, found_inf

    return step


@dataclass(eq=False)
class RunState:
    config: DemoConfig
    gpt: GPTConfig
    batches: Batches
    dense_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict] | None = None
    scaler_state: dict | None = None
    start_step: int = 0
    # written by the ranks (each writes its own keys; rank 0 appends to the lists)
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)  # the MoE aux part of each loss
    grad_norms: list[float | None] = field(default_factory=list)  # before clipping; None: step skipped (fp16)
    step_seconds: list[float] = field(default_factory=list)
    timelines: dict[int, Timeline] = field(default_factory=dict)
    activation_peaks: dict[int, int] = field(default_factory=dict)
    device_peaks: dict[int, int | None] = field(default_factory=dict)
    optimizer_state_bytes: dict[int, int] = field(default_factory=dict)
    model_parts: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    optimizer_parts: dict[int, dict[str, dict]] = field(default_factory=dict)
    final_scaler_state: dict | None = None
    skipped_steps: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.seq_len


def train_rank(run: RunState) -> None:
    cfg, rank = run.config, get_rank()
    assert cfg.microbatches is not None  # __post_init__ derived it
    layout, coords = get_layout(), get_coords()
    scaler = LossScaler(get_group()) if cfg.dtype == "fp16" else None
    if scaler is not None and run.scaler_state:
        scaler.load_state_dict(run.scaler_state)
    model = parallelize_gpt(
        run.gpt,
        run.dense_state,
        schedule=cfg.schedule,
        num_microbatches=cfg.microbatches,
        sequence_parallel=cfg.sequence_parallel,
        ep=cfg.ep,
        recompute=cfg.recompute,
        autocast_dtype=AUTOCAST[cfg.dtype],
        loss_scaler=scaler,
        compile=cfg.compile,
    )
    params = list(model.parameters())
    optimizer = make_optimizer(
        params,
        cfg.lr,
        cfg.zero,
        capturable=cfg.cuda_graphs and graphs_here(),
        fused=cfg.cuda_graphs and scaler is not None,  # (the graphed fp16 step skips on the device)
    )
    if run.optimizer_state is not None:
        load_optimizer_state(optimizer, model.chunks, run.optimizer_state)
    tracker = SavedActivationTracker()
    dp_group = get_group("DP")
    bar = ProgressBar(cfg.steps) if rank == 0 else None
    graphed = (
        graphed_step(device_step(model, optimizer, params, cfg.clip_grad, scaler))
        if cfg.cuda_graphs
        else None
    )

    for step in range(run.start_step, cfg.steps):
        inputs, targets = run.batches.batch(step)  # the global batch, the same on every rank
        inputs = data_parallel_slice(inputs, coords.dp, layout.dp).to(get_device())
        targets = data_parallel_slice(targets, coords.dp, layout.dp).to(get_device())
        start = time.perf_counter()
        # Saved-activation bytes are the same every step unless MoE routing changes the shapes: count them on
        # the first step only. A Python hook per saved tensor cost a tiny model's step 5% with the ranks on
        # one core and a quarter spread over two (each unpack hook takes the GIL inside the backward).
        with tracker.track() if step == run.start_step or cfg.moe_experts else contextlib.nullcontext():
            if graphed is not None:
                loss_and_aux, norm, found_inf = graphed(inputs, targets)
            else:
                loss = model.train_step(inputs, targets)
        if graphed is not None:  # (host reads after the step: None for a step skipped on an fp16 overflow)
            grad_norm: float | None = None if found_inf.item() else float(norm)
        else:
            grad_norm = clip_and_step(optimizer, params, scaler, cfg.clip_grad)
            optimizer.zero_grad(set_to_none=True)
            # The replica's loss is the same on its CP, TP and PP ranks; the mean over DP is the global batch's.
            assert model.last_aux is not None  # (train_step set it)
            loss_and_aux = torch.stack([loss.detach(), model.last_aux])
            dp_group.all_reduce(loss_and_aux, op=ReduceOp.AVG)
        if rank == 0:
            seconds = time.perf_counter() - start
            run.losses.append(loss_and_aux[0].item())
            run.aux_losses.append(loss_and_aux[1].item())
            run.grad_norms.append(grad_norm)
            run.step_seconds.append(seconds)
            if bar is not None and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
                bar.update(step + 1, run.losses[-1], run.tokens_per_step / seconds)
    if bar is not None:
        bar.close()

    run.timelines[rank] = model.pipeline.timeline.snapshot()
    run.activation_peaks[rank] = tracker.peak
    run.device_peaks[rank] = device_peak_bytes(get_device())
    run.optimizer_state_bytes[rank] = optimizer_state_bytes(optimizer)
    if scaler is not None and rank == 0:
        run.final_scaler_state = scaler.state_dict()
        run.skipped_steps = scaler.skipped_steps
    if cfg.checkpoint is not None:
        # Collectives over each TP and EP group; one rank per pipeline stage hands the dense parts over.
        model_state = model.dense_state()
        optimizer_state = model.dense_optimizer_state(optimizer)
        if coords.dp == 0 and coords.tp == 0 and coords.cp == 0:
            run.model_parts[coords.pp] = model_state
            run.optimizer_parts[coords.pp] = optimizer_state
