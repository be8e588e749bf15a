"""A decoder-only GPT in one readable file (after nanoGPT), written in plain PyTorch. Its configuration
(GPTConfig, the named sizes) is in config.py; `parallelize_gpt.parallelize_chunk` makes it tensor-, sequence-,
context- and expert-parallel (torchtitan's shape: a plain model, then one function that applies the layout).

    idx [B, T] -> Embedding (token + learned position) -> Block x n_layer -> Head (final norm, LM head)

A Block is pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); attention is causal multi-head
(F.scaled_dot_product_attention). Every module is plain PyTorch (nn.Linear, nn.Embedding, F.cross_entropy),
and the code does not depend on the split sizes: attention takes its number of heads from the tensor (a
tensor-parallel rank holds n_head / tp of them). What the parallel forms need beyond swapped layers is a
slot each, None in the plain model and set by `parallelize_chunk`: the embedding's sequence-parallel group
(it scatters its output along T) and CP group (its positions are this rank's part of each sequence),
attention's `ring` (ring attention over the CP group), the chunk's `tp` and `cp` (for its loss). Whatever the
layout, the model computes the same function as the plain one (tests check it).

Pipeline chunks: `GPTChunk(config, layers=range(a, b), first=..., last=...)` holds the embedding if
first, blocks a..b-1 under their global indices, and the head if last. The whole model is the chunk with
every layer, so parameter names (`blocks.3.attn.qkv.weight`) are the same in a chunk, in the full model,
and in a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.models.config import MODEL_SIZES, GPTConfig, model_config
from threadpar.parallel.context_parallel import RingAttention, load_balanced_indices
from threadpar.parallel.expert_parallel import MoE
from threadpar.parallel.tensor_parallel import scatter_to_sp_region, vocab_parallel_cross_entropy

__all__ = ["GPT", "MODEL_SIZES", "GPTChunk", "GPTConfig", "GPTLoss", "TensorParallel", "model_config"]

IGNORE_INDEX = -100  # targets that take no part in the loss (F.cross_entropy's default)


@dataclass(kw_only=True)
class TensorParallel:
    """How a GPT is split over a TP group. Under sequence parallelism T must be divisible by the TP size.
    overlap_grad_comm: the column-parallel layers overlap their input-gradient collective with the
    weight-gradient GEMM in backward (ColumnParallelLinear's option; None: where it helps)."""

    group: ProcessGroup
    sequence_parallel: bool = False
    overlap_grad_comm: bool | None = None

    @property
    def size(self) -> int:
        return self.group.size()


class Embedding(nn.Module):
    """Token + learned position embedding: idx [B, T] -> x [B, T, C], or [B, T / tp, C] under SP.
    Under CP, idx is this rank's part [B, T / cp] and the positions are those it holds."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # VocabParallelEmbedding under TP
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.cp: ProcessGroup | None = None  # set by parallelize_chunk under context parallelism
        self.sequence_parallel_group: ProcessGroup | None = None  # ... and under sequence parallelism

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if self.cp is None:
            positions = torch.arange(T, device=idx.device)
        else:  # this rank's chunks of the whole sequence of T * cp positions
            cp = self.cp.size()
            positions = load_balanced_indices(T * cp, cp, self.cp.rank(), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # [B, T, C], whole on every TP rank
        if self.sequence_parallel_group is not None:
            x = scatter_to_sp_region(x, self.sequence_parallel_group, dim=1)  # [B, T / tp, C]
        return self.drop(x)


def _linears(config: GPTConfig, d_in: int, d_out: int, *, stride: int = 1) -> tuple[nn.Linear, nn.Linear]:
    """An (up, down) pair: up [C -> d_out], down [d_out / stride -> C] (column- and row-parallel under TP)."""
    return nn.Linear(d_in, d_out, bias=config.bias), nn.Linear(d_out // stride, d_in, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        # qkv: dense weight [3C, C] laid out [q; k; v] (under TP, stride 3 gives rank r its heads of each).
        self.qkv, self.proj = _linears(config, config.n_embd, 3 * config.n_embd, stride=3)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)
        # Under CP (set by parallelize_chunk): this rank's queries on the whole sequence's keys, in a ring.
        self.ring: RingAttention | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, 3 * h * d], h = this rank's heads (whole T: SP gathered it; T / cp)
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if self.ring is not None:
            y = self.ring(q, k, v)  # [B, h, T / cp, d]
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # [B, h, T, d]
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))  # [B, T, C] (or [B, T / tp, C] under SP)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc, self.proj = _linears(config, config.n_embd, 4 * config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # hidden [B, T, 4C / tp] stays split under TP


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        moe = config.moe_config()  # a MoE in place of the MLP (the MoE default group: see MoE)
        self.mlp: MLP | MoE = MLP(config) if moe is None else MoE(moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final norm and LM head: x -> logits [B, T, V], or [B, T, V / tp] split over the vocabulary."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPTChunk(nn.Module):
    """Consecutive layers of a GPT: the embedding if `first`, blocks `layers` (global indices), the head
    if `last`. `recompute` re-runs each block's forward in backward instead of keeping its activations.
    Plain PyTorch: `parallelize_gpt.parallelize_chunk(chunk, tp=..., cp=..., ep=...)` splits it."""

    def __init__(
        self,
        config: GPTConfig,
        layers: range | None = None,
        *,
        first: bool = True,
        last: bool = True,
        recompute: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        layers = range(config.n_layer) if layers is None else layers
        if layers and not (layers.start >= 0 and layers.stop <= config.n_layer):
            raise ConfigError(f"layers {layers} are outside the model's 0..{config.n_layer - 1}")
        self.config = config
        self.tp: TensorParallel | None = None  # set by parallelize_chunk
        self.cp: ProcessGroup | None = None
        self.embedding = Embedding(config) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in layers})
        self.head = Head(config) if last else None
        self.recompute = recompute
        self.autocast_dtype = autocast_dtype
        # This chunk's MoE aux losses summed over forwards (set it to 0 to restart): a device tensor once a MoE
        # forward ran (summed on the device: a CUDA graph can hold it), the number 0.0 before.
        self.aux_loss_sum: float | torch.Tensor = 0.0
        self.set_aux_loss_scale(1.0)

    @property
    def moe_layers(self) -> list[MoE]:
        return [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size()

    def set_aux_loss_scale(self, scale: float | torch.Tensor) -> None:
        """Tell the MoE layers what the loss is multiplied by before backward (1 / microbatches, an fp16
        loss scale), since their aux losses join it in backward. Under CP the factor cp of GPTLoss's rank
        losses is added here."""
        for moe in self.moe_layers:
            moe.aux_loss_scale = self.cp_size * scale

    def last_aux_loss(self) -> float:
        """The MoE aux losses of the last forward (this rank's share, times cp like GPTLoss's), 0 without MoE
        (a host read of `last_aux_loss_tensor`)."""
        return float(self.last_aux_loss_tensor()) if self.moe_layers else 0.0

    def last_aux_loss_tensor(self) -> torch.Tensor:
        """`last_aux_loss` on the device (0-dim float32), read nowhere: a CUDA graph can hold it."""
        stats = [moe.last_stats for moe in self.moe_layers]
        if not stats or any(s is None for s in stats):
            raise RuntimeError("last_aux_loss() reads the MoE stats of the last forward: run a forward first")
        return self.cp_size * torch.stack([s.aux_loss_tensor.float() for s in stats if s is not None]).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """idx [B, T] (first chunk) or hidden states -> hidden states, or logits (last chunk)."""
        if self.autocast_dtype is None:
            return self._forward(x)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        if self.head is not None:
            x = self.head(x)
        if self.moe_layers:  # read here, not in the blocks: recompute re-runs them in backward
            self.aux_loss_sum = self.aux_loss_sum + self.last_aux_loss_tensor()
        return x


class GPT(GPTChunk):
    """The whole model: one chunk with every layer, in plain PyTorch (see parallelize_chunk)."""

    def __init__(self, config: GPTConfig, **kwargs) -> None:
        super().__init__(config, range(config.n_layer), first=True, last=True, **kwargs)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss: mean next-token cross-entropy plus the MoE aux losses. The aux part is a
        value only: the MoE outputs carry its gradient (scaled by set_aux_loss_scale)."""
        loss = GPTLoss(self.config, self.tp, self.cp)(self(idx), targets)
        if not self.moe_layers:
            return loss
        aux = self.last_aux_loss_tensor().to(loss.dtype)
        if self.tp is not None and self.tp.sequence_parallel:
            self.tp.group.all_reduce(aux)  # each TP rank routed its shard of the sequence
        return loss + aux

    def accumulate_gradients(
        self, idx: torch.Tensor, targets: torch.Tensor, forwards: int = 1
    ) -> torch.Tensor:
        """The single-thread oracle of a data-parallel, microbatched step: forward and backward of the
        batch in `forwards` equal consecutive parts (a MoE routes, drops and balances per forward, as each
        replica does with each microbatch), gradients of the mean loss accumulated. Returns that mean."""
        if idx.shape[0] % forwards:
            raise ConfigError(f"a batch of {idx.shape[0]} does not split into {forwards} equal forwards")
        self.set_aux_loss_scale(1.0 / forwards)
        losses = []
        for x, y in zip(idx.chunk(forwards), targets.chunk(forwards)):
            loss = self.loss(x, y)
            (loss / forwards).backward()
            losses.append(loss.detach())
        self.set_aux_loss_scale(1.0)
        return torch.stack(losses).mean()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> GPT:
        """nanoGPT's initialisation, drawn from `generator` (not the process-wide RNG)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:  # the projections into the residual stream (the MoE experts' fc2 too) start smaller
                std = residual_std if name.endswith(("proj.weight", "fc2_weight")) else 0.02
                p.normal_(0.0, std, generator=generator)
        return self

    @classmethod
    def from_checkpoint(cls, path: str, **kwargs) -> GPT:
        """A plain single-thread GPT from a threadpar checkpoint (an unsplit state dict)."""
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        model = cls(GPTConfig(**ckpt["config"]), **kwargs)
        model.load_state_dict(ckpt["model"])
        return model


class GPTLoss(nn.Module):
    """Mean next-token cross-entropy in fp32 (targets equal to -100 are ignored). Under TP the logits are
    [B, T, V / tp] (padded vocabulary entries excluded) and are never gathered: the vocab-parallel loss
    all-reduces a max and a sum-exp. Under CP a rank holds part of each sequence: its loss is its tokens'
    summed loss over the whole sequences' token count (one all-reduce of a count), times cp, so the mean
    of the CP ranks' losses is the loss of the whole sequences, and so is DDP's average of gradients."""

    def __init__(
        self, config: GPTConfig, tp: TensorParallel | None = None, cp: ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.tp = tp
        self.cp = cp if cp is not None and cp.size() > 1 else None

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        reduction = "mean" if self.cp is None else "sum"
        if self.tp is None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
        else:
            loss = vocab_parallel_cross_entropy(
                logits.float(), targets, vocab_size=self.vocab_size, group=self.tp.group, reduction=reduction
            )
        if self.cp is None:
            return loss
        count = (targets != IGNORE_INDEX).sum()
        self.cp.all_reduce(count)  # the tokens of the whole sequences
        return loss * self.cp.size() / count.clamp(min=1)
