"""This rank's part of a GPT under the launch's DP x CP x TP x PP layout (and EP), and its training step.

torchtitan's shape: the model is built plain (models/gpt.py), then one ordered function applies the
layout. `parallelize_gpt` is that function for a launch:
  1. pipeline: `get_stage_info` gives this rank's chunks (layer ranges) of the PP group, built plain;
  2. `parallelize_chunk` on each chunk:
     a. expert parallel: with MoE blocks, each MoE is swapped for one whose experts are sharded over the
        EP group (routing counted over the ranks that hold the rest of each sequence);
     b. tensor (and sequence) parallel: the TP plan (`gpt_tp_plan`) swaps the linear layers and the
        token embedding for TP layers over the TP group (`parallelize`), and marks the norms (and MoEs)
        that run on sequence shards;
     c. context parallel: with cp > 1 attention is swapped for ring attention over the CP group and the
        embedding takes this rank's positions of each sequence;
  3. weights: every rank loads its shard of the same dense weights, so the layout changes nothing;
  4. compile (optional): each transformer block is torch.compile'd in place (torchtitan compiles per
     block too): the unit every layout shares, whose collectives (TP mappings) become graph breaks;
  5. data parallel: each chunk is wrapped in DDP over the DP group (DP x CP under CP; sharded experts
     over the ranks holding the same experts); the pipeline's lowered plan synchronizes each chunk's
     gradients once per step (SYNC_GRAD), overlapping its last backward.
The MoE swap comes before the TP plan so that the plan's sequence-parallel marks land on the MoE that
trains. `parallelize_chunk` alone is the way into TP/CP/EP for a model outside a pipeline (tests, demos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from threadpar.checkpoint import gather_model_state, gather_optimizer_state, load_model_state
from threadpar.comm import get_group
from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.models.gpt import Block, GPTChunk, GPTConfig, GPTLoss, TensorParallel
from threadpar.parallel import DistributedDataParallel, mark_grad_placements
from threadpar.parallel.context_parallel import RingAttention, padding_multiple, split_sequence
from threadpar.parallel.expert_parallel import MoE
from threadpar.parallel.groups import expert_groups, routing_group
from threadpar.parallel.loss_scaler import LossScaler
from threadpar.parallel.tensor_parallel import (
    ColwiseParallel,
    VocabParallel,
    allreduce_sequence_parallel_grads,
    gather_dense_grads,
    parallelize,
)
from threadpar.parallel.tensor_parallel.parallelize import Style
from threadpar.pipeline import PipelineParallel, default_chunks_per_rank, get_stage_info, schedule_placement
from threadpar.runtime.compiling import keep_dynamo_out_of_comm
from threadpar.runtime.context import get_coords, get_device, get_layout


def gpt_tp_plan(chunk: GPTChunk, sequence_parallel: bool) -> dict[str, str | Style]:
    """The GPT's tensor-parallel plan (`parallelize`'s), for the modules this chunk holds:
    - q/k/v: one column-parallel layer with stride 3, so each rank holds whole heads (n_head / tp);
    - attention output projection and MLP down-projection: row-parallel (one all-reduce each);
    - MLP up-projection: column-parallel; the token embedding vocab-parallel (its output whole: the
      embedding adds the positions, then scatters the sequence itself under SP), and so is the LM head,
      whose logits stay split over the (padded) vocabulary for the vocab-parallel cross-entropy;
    - under sequence parallelism the norms (and MoEs, whose experts are not split over TP) run on
      sequence shards: their gradients are partial sums over the TP group."""
    plan: dict[str, str | Style] = {}
    if chunk.embedding is not None:
        plan["embedding.wte"] = VocabParallel(reduce_scatter=False)
    if chunk.blocks:
        plan["blocks.*.attn.qkv"] = ColwiseParallel(stride=3)
        plan["blocks.*.attn.proj"] = "rowwise"
        if chunk.moe_layers:
            if sequence_parallel:
                plan["blocks.*.mlp"] = "sequence"
        else:
            plan["blocks.*.mlp.fc"] = "colwise"
            plan["blocks.*.mlp.proj"] = "rowwise"
        if sequence_parallel:
            plan["blocks.*.ln_*"] = "sequence"
    if chunk.head is not None:
        plan["head.lm_head"] = ColwiseParallel(pad_out_features_to_multiple_of=1)
        if sequence_parallel:
            plan["head.ln_f"] = "sequence"
    return plan


def parallelize_chunk(
    chunk: GPTChunk,
    *,
    tp: TensorParallel | None = None,
    cp: ProcessGroup | None = None,
    ep: ProcessGroup | None = None,
) -> GPTChunk:
    """Make a plain GPT chunk (or GPT) this rank's part of the layout, in place; return it. In order: the
    MoE swap (experts sharded over `ep`: `expert_groups()[0]`; None: the MoE default, the DP
    group inside a launch), the TP plan over `tp` (`gpt_tp_plan`), the CP swap (ring attention over `cp`,
    and each sequence's positions split as `split_sequence` splits it). Call it on the rank thread, before
    loading the dense weights (`load_model_state`) and before wrapping in DDP."""
    config = chunk.config
    cp = cp if cp is not None and cp.size() > 1 else None
    if tp is not None and config.n_head % tp.size:
        raise ConfigError(
            f"n_head={config.n_head} is not divisible by tp={tp.size}; pick a tp that divides it"
        )
    if (tp is not None or cp is not None or ep is not None) and config.dropout > 0:
        raise ConfigError(
            "dropout > 0 is supported in the plain GPT only: nn.Dropout draws from the process-wide generator "
            "that all rank threads share; train the parallel GPT with dropout=0"
        )
    sp = tp is not None and tp.sequence_parallel
    # a. expert parallel: the MoEs with their EP group and the group they count routing over
    moe_config = config.moe_config() if chunk.blocks else None
    routing = routing_group(None if tp is None else tp.group, sp, cp) if moe_config is not None else None
    if moe_config is not None and (ep is not None or routing is not None):
        for block in chunk.blocks.values():
            assert isinstance(block, Block)
            block.mlp = MoE(moe_config, ep, aux_loss_group=routing)
    # b. tensor (and sequence) parallel
    if tp is not None:
        plan = gpt_tp_plan(chunk, sp)
        if plan:
            parallelize(
                chunk, plan, group=tp.group, sequence_parallel=sp, overlap_grad_comm=tp.overlap_grad_comm
            )
        if sp and chunk.embedding is not None:
            chunk.embedding.sequence_parallel_group = tp.group
        chunk.tp = tp
    # c. context parallel
    if cp is not None:
        for block in chunk.blocks.values():
            assert isinstance(block, Block)
            block.attn.ring = RingAttention(cp)
        if chunk.embedding is not None:
            chunk.embedding.cp = cp
        chunk.cp = cp
    chunk.set_aux_loss_scale(1.0)  # the factor cp of the new MoEs
    return chunk


@dataclass(eq=False)
class HybridGPT:
    """This rank's chunks (unwrapped), what the pipeline runs (DDP-wrapped when dp x cp > 1), the pipeline."""

    config: GPTConfig
    chunks: list[GPTChunk]
    modules: list[nn.Module]
    pipeline: PipelineParallel
    tp: TensorParallel | None
    loss_scaler: LossScaler | None = None
    cp: ProcessGroup | None = None
    # The MoE aux losses in the last step's loss (a 0-dim tensor on the device; None before the first step):
    # kept on the device, so that a step reads no value on the host (a CUDA graph can hold it).
    last_aux: torch.Tensor | None = None

    @property
    def last_aux_loss(self) -> float:
        """`last_aux` as a number (a host read of the device's value)."""
        return 0.0 if self.last_aux is None else float(self.last_aux)

    def parameters(self) -> Iterator[nn.Parameter]:
        for chunk in self.chunks:
            yield from chunk.parameters()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this DP replica's batch [B, T] through the pipeline; gradients are
        complete (averaged over DP x CP, summed over TP for sequence-parallel replicas) when it returns.
        Returns the replica's mean loss (cross-entropy plus MoE aux losses) on every rank of the replica."""
        scaler = self.loss_scaler
        # The MoE layers scale their aux losses' gradients as the loss is scaled: by the fp16 scale on the device
        # (MoE.aux_loss_scale takes a tensor; nothing here reads the host, so a CUDA graph can hold the step).
        aux_scale: float | torch.Tensor = 1.0 if scaler is None else scaler.scale_tensor
        n = self.pipeline.num_microbatches
        if self.cp is not None:  # this rank's load-balanced part of every sequence: [B, T / cp]
            self._check_sequence(inputs.shape[1])
            inputs, targets = split_sequence(inputs, 1, self.cp), split_sequence(targets, 1, self.cp)
        for chunk in self.chunks:
            chunk.aux_loss_sum = 0.0
            chunk.set_aux_loss_scale(aux_scale / n)  # each microbatch's loss is scaled by `scale / n`, too
        loss = self.pipeline.train_step(inputs, targets)  # its rank losses (times cp under CP)
        if scaler is not None:
            loss = loss / scaler.scale_tensor.to(loss.device)  # (the scale its microbatches were scaled by)
        if self.tp is not None and self.tp.sequence_parallel:
            for chunk in self.chunks:
                allreduce_sequence_parallel_grads(chunk, self.tp.group)
        # The MoE aux losses joined the loss in backward, on every stage; add their values to what it reports.
        aux = loss.new_zeros(())  # (made on the device, the MoE sums kept there: a CUDA graph can hold it)
        for chunk in self.chunks:
            aux = aux + chunk.aux_loss_sum / n
        if self.config.moe_experts and self.pipeline.pp > 1:
            self.pipeline.group.all_reduce(aux)
        if self.config.moe_experts and self.tp is not None and self.tp.sequence_parallel:
            self.tp.group.all_reduce(aux)  # each TP rank routed its shard of the sequences
        parts = torch.stack([loss, aux])
        if self.cp is not None:
            self.cp.all_reduce(parts, ReduceOp.AVG)  # the rank losses' mean is the whole sequences' loss
        self.last_aux = parts[1].detach()
        return parts.sum()

    def _check_sequence(self, seq_len: int) -> None:
        assert self.cp is not None  # checked under context parallelism only
        sp = self.tp is not None and self.tp.sequence_parallel
        tp_size = 1 if self.tp is None else self.tp.size
        multiple = padding_multiple(self.cp.size(), tp_size, sp)
        if seq_len % multiple:
            raise ConfigError(
                f"a sequence of {seq_len} tokens does not split over cp={self.cp.size()}"
                + (f" x tp={tp_size} (sequence parallel)" if sp else "")
                + f": its length must be a multiple of {multiple} (two chunks per CP rank"
                + (", each split over TP)" if sp else ")")
                + "; use such a length, or pad inputs and targets at the end (pad_sequence; targets with -100, "
                "which the loss ignores) with a block_size that covers the padded length"
            )

    def dense_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters at dense shapes (collective over the TP and EP groups)."""
        return gather_model_state(self.chunks)

    def dense_grads(self) -> dict[str, torch.Tensor | None]:
        """This stage's gradients at dense shapes (collective over the TP and EP groups), for parity checks."""
        grads: dict[str, torch.Tensor | None] = {}
        for chunk in self.chunks:
            grads.update(gather_dense_grads(chunk))
        return grads

    def dense_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
        return gather_optimizer_state(optimizer, self.chunks)


def parallelize_gpt(
    config: GPTConfig,
    dense_state: dict[str, torch.Tensor],
    *,
    schedule: str = "1f1b",
    num_microbatches: int = 1,
    sequence_parallel: bool = False,
    ep: int | None = None,
    recompute: bool = False,
    autocast_dtype: torch.dtype | None = None,
    loss_scaler: LossScaler | None = None,
    bucket_cap_mb: float = 25.0,
    compile: str | Callable[..., Any] | None = None,
) -> HybridGPT:
    """Build this rank's part of the GPT (call on every rank of the launch, with the same arguments).

    ep: the expert-parallel size of a MoE GPT (config.moe_experts > 0): the experts are sharded over runs of
    ep ranks of each DP x CP group (ep divides dp * cp; the launch's EP groups when it equals launch(ep=));
    1 keeps every expert on every rank; None: the launch's ep.
    loss_scaler: fp16 loss scaling; each microbatch loss is multiplied by its current scale before
    backward, by the scale on the device (train_step returns the unscaled loss; step the optimizer with
    `loss_scaler.step`, or in a CUDA graph `loss_scaler.step_on_device`).
    The dense weights come from the caller, so that every layout starts from the same model.
    compile: a torch.compile backend (a name: "inductor", "aot_eager"; or a callable) to compile every transformer block with
    (Module.compile, in place: names and state dicts stay those of the eager model); None: eager. Import
    torch._dynamo before the launch, so that it raises dynamo's recompile limits for the rank threads
    (threadpar.runtime.compiling).
    """
    if config.dropout > 0:
        raise ConfigError(
            "parallelize_gpt: dropout > 0 is not supported (nn.Dropout draws from the process-wide generator "
            "that all rank threads share); train with dropout=0"
        )
    if ep is not None and ep != 1 and not config.moe_experts:
        raise ConfigError(f"parallelize_gpt: ep={ep} needs a MoE model; set GPTConfig.moe_experts (or ep=1)")
    layout, coords = get_layout(), get_coords()
    tp = TensorParallel(group=get_group("TP"), sequence_parallel=sequence_parallel) if layout.tp > 1 else None
    cp = get_group("CP") if layout.cp > 1 else None
    ep_group = expert_groups(ep)[0] if config.moe_experts else None
    chunks_per_stage = default_chunks_per_rank(schedule)
    info = get_stage_info(
        config.n_layer, layout.pp, coords.pp, chunks_per_stage, schedule_placement(schedule)
    )
    last_chunk = layout.pp * chunks_per_stage - 1
    # Made on this rank's device (torch's device context: every factory there), never moved: the dense
    # weights load there, and nothing holds a parameter that .to() would have to replace.
    with torch.device(get_device()):
        chunks = [
            parallelize_chunk(
                GPTChunk(
                    config,
                    range(start, end),
                    first=chunk == 0,
                    last=chunk == last_chunk,
                    recompute=recompute,
                    autocast_dtype=autocast_dtype,
                ),
                tp=tp,
                cp=cp,
                ep=ep_group,
            )
            for chunk, (start, end) in zip(info.chunk_ids, info.layer_ranges_per_chunk)
        ]
    load_model_state(chunks, dense_state)
    if compile is not None:
        keep_dynamo_out_of_comm()  # the TP mappings' collectives break the blocks' graphs, untraced
        for chunk in chunks:
            for block in chunk.blocks.values():
                block.compile(backend=compile)
    modules: list[nn.Module] = list(chunks)
    if layout.dp * layout.cp > 1:  # DDP's default group: DP, or DP x CP under context parallelism
        modules = [DistributedDataParallel(c, bucket_cap_mb=bucket_cap_mb) for c in chunks]
    else:  # DDP marks what it wraps; without it, mark the gradients' placement here (for clip_grad_norm_)
        for chunk in chunks:
            mark_grad_placements(chunk)
    criterion = GPTLoss(config, tp, cp)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = criterion(logits, targets)
        return loss if loss_scaler is None else loss_scaler.scale_loss(loss)

    pipeline = PipelineParallel(
        modules, loss_fn=loss_fn, schedule=schedule, num_microbatches=num_microbatches, group="PP"
    )
    return HybridGPT(config, chunks, modules, pipeline, tp, loss_scaler, cp)
