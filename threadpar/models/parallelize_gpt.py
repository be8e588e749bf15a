"""This rank's part of a GPT under the launch's DP x TP x PP layout, and its training step.

`parallelize_gpt` applies the parallelisms in one short, ordered function (torchtitan's shape):
  1. pipeline: `get_stage_info` gives this rank's chunks (layer ranges) of the PP group;
  2. tensor (and sequence) parallel: each chunk is built from TP layers over the TP group;
  3. weights: every rank loads its shard of the same dense weights, so the layout changes nothing;
  4. data parallel: each chunk is wrapped in DDP over the DP group; the pipeline runs every backward but
     a chunk's last inside `no_sync()`, so gradients are averaged once per step, overlapping that backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from threadpar.checkpoint import gather_model_state, gather_optimizer_state, load_model_state
from threadpar.errors import ConfigError
from threadpar.models.gpt import GPTChunk, GPTConfig, GPTLoss, TensorParallel
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.loss_scaler import LossScaler
from threadpar.parallel.tensor_parallel import allreduce_sequence_parallel_grads, gather_dense_grads
from threadpar.pipeline import PipelineParallel, get_stage_info
from threadpar.runtime.context import get_coords, get_group, get_layout


@dataclass(eq=False)
class HybridGPT:
    """This rank's chunks (unwrapped), what the pipeline runs (DDP-wrapped when dp > 1), and the pipeline."""

    config: GPTConfig
    chunks: list[GPTChunk]
    modules: list[nn.Module]
    pipeline: PipelineParallel
    tp: TensorParallel | None
    loss_scaler: LossScaler | None = None

    def parameters(self) -> Iterator[nn.Parameter]:
        for chunk in self.chunks:
            yield from chunk.parameters()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this DP replica's batch through the pipeline; gradients are complete
        (averaged over DP, summed over TP for sequence-parallel replicas) when it returns. Returns the
        replica's mean loss on every rank of its pipeline."""
        scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
        loss = self.pipeline.train_step(inputs, targets)
        if self.tp is not None and self.tp.sequence_parallel:
            for chunk in self.chunks:
                allreduce_sequence_parallel_grads(chunk, self.tp.group)
        return loss / scale

    def dense_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters at dense shapes (collective over the TP group)."""
        return gather_model_state(self.chunks)

    def dense_grads(self) -> dict[str, torch.Tensor | None]:
        """This stage's gradients at dense shapes (collective over the TP group), for parity checks."""
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
    recompute: bool = False,
    autocast_dtype: torch.dtype | None = None,
    loss_scaler: LossScaler | None = None,
    bucket_cap_mb: float = 25.0,
) -> HybridGPT:
    """Build this rank's part of the GPT (call on every rank of the launch, with the same arguments).

    loss_scaler: fp16 loss scaling; each microbatch loss is multiplied by its current scale before
    backward (train_step returns the unscaled loss; step the optimizer with `loss_scaler.step`).
    The dense weights come from the caller, so that every layout starts from the same model.
    """
    if config.dropout > 0:
        raise ConfigError(
            "parallelize_gpt: dropout > 0 is not supported (nn.Dropout draws from the process-wide generator "
            "that all rank threads share); train with dropout=0"
        )
    layout, coords = get_layout(), get_coords()
    tp = TensorParallel(group=get_group("TP"), sequence_parallel=sequence_parallel) if layout.tp > 1 else None
    chunks_per_stage = 2 if schedule == "interleaved" else 1
    info = get_stage_info(config.n_layer, layout.pp, coords.pp, chunks_per_stage)
    last_chunk = layout.pp * chunks_per_stage - 1
    options = dict(tp=tp, recompute=recompute, autocast_dtype=autocast_dtype)
    chunks = [
        GPTChunk(config, range(start, end), first=chunk == 0, last=chunk == last_chunk, **options)
        for chunk, (start, end) in zip(info.chunk_ids, info.layer_ranges_per_chunk)
    ]
    load_model_state(chunks, dense_state)
    modules: list[nn.Module] = list(chunks)
    if layout.dp > 1:
        modules = [
            DistributedDataParallel(c, process_group="DP", bucket_cap_mb=bucket_cap_mb) for c in chunks
        ]
    criterion = GPTLoss(config, tp)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = criterion(logits, targets)
        return loss if loss_scaler is None else loss * loss_scaler.scale

    pipeline = PipelineParallel(
        modules, loss_fn=loss_fn, schedule=schedule, num_microbatches=num_microbatches, group="PP"
    )
    return HybridGPT(config, chunks, modules, pipeline, tp, loss_scaler)
