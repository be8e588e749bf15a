"""A decoder-only GPT in one readable file (after nanoGPT), tensor-, sequence- and pipeline-parallel.

    idx [B, T] -> Embedding (token + learned position) -> Block x n_layer -> Head (final norm, LM head)

A Block is pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); attention is causal multi-head
(F.scaled_dot_product_attention). Built with `tp=None` every module is plain PyTorch (nn.Linear,
nn.Embedding, F.cross_entropy). Built with a TensorParallel spec the same modules use threadpar's layers:
  - q/k/v: one ColumnParallelLinear with stride 3, so each rank holds whole heads (n_head / tp of them);
  - attention output projection and MLP down-projection: RowParallelLinear (one all-reduce each);
  - MLP up-projection: ColumnParallelLinear; the token embedding is vocab-parallel, and so is the LM head,
    whose logits stay split over the vocabulary for the vocab-parallel cross-entropy;
  - with sequence parallelism, activations outside attention/MLP are split along T ([B, T / tp, C]):
    layer norms run on sequence shards (their gradients are summed over the TP group by
    `allreduce_sequence_parallel_grads`), and the all-reduces become all-gather + reduce-scatter.
Whatever the layout, the model computes the same function as the plain one (tests check it).

Pipeline chunks: `GPTChunk(config, layers=range(a, b), first=..., last=...)` holds the embedding if
first, blocks a..b-1 under their global indices, and the head if last. The whole model is the chunk with
every layer, so parameter names (`blocks.3.attn.qkv.weight`) are the same in a chunk, in the full model,
and in a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    scatter_to_sp_region,
    vocab_parallel_cross_entropy,
)


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # the longest sequence
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(n_layer=8, n_head=8, n_embd=128),
    "medium": GPTConfig(n_layer=12, n_head=8, n_embd=256),
    "large": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
}


def model_config(size: str, *, block_size: int, dropout: float = 0.0) -> GPTConfig:
    if size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return replace(MODEL_SIZES[size], block_size=block_size, dropout=dropout)


@dataclass(kw_only=True)
class TensorParallel:
    """How a GPT is split over a TP group. Under sequence parallelism T must be divisible by the TP size."""

    group: ProcessGroup
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return self.group.size()


def _check_tp(config: GPTConfig, tp: TensorParallel | None) -> None:
    if tp is None:
        return
    if config.n_head % tp.size:
        raise ConfigError(
            f"n_head={config.n_head} is not divisible by tp={tp.size}; pick a tp that divides it"
        )
    if config.dropout > 0:
        raise ConfigError(
            "dropout > 0 is supported in the plain GPT only: nn.Dropout draws from the process-wide generator "
            "that all rank threads share; train the parallel GPT with dropout=0"
        )


class Embedding(nn.Module):
    """Token + learned position embedding: idx [B, T] -> x [B, T, C], or [B, T / tp, C] under SP."""

    def __init__(self, config: GPTConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp
        if tp is None:
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        else:
            self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group=tp.group)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # [B, T, C], whole on every rank
        if self.tp is not None and self.tp.sequence_parallel:
            x = scatter_to_sp_region(x, self.tp.group, dim=1)  # [B, T / tp, C]
        return self.drop(x)


def _linears(config: GPTConfig, tp: TensorParallel | None, d_in: int, d_out: int, *, stride: int = 1):
    """An (up, down) pair: up [C -> d_out] column-parallel, down [d_out -> C] row-parallel under TP."""
    if tp is None:
        return nn.Linear(d_in, d_out, bias=config.bias), nn.Linear(d_out // stride, d_in, bias=config.bias)
    sp = tp.sequence_parallel
    up = ColumnParallelLinear(d_in, d_out, config.bias, stride=stride, sequence_parallel=sp, group=tp.group)
    down = RowParallelLinear(d_out // stride, d_in, config.bias, sequence_parallel=sp, group=tp.group)
    return up, down


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.local_heads = config.n_head // (1 if tp is None else tp.size)
        # qkv: dense weight [3C, C] laid out [q; k; v]; stride 3 gives rank r its heads of each block.
        self.qkv, self.proj = _linears(config, tp, config.n_embd, 3 * config.n_embd, stride=3)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, 3 * h * d] with h = this rank's heads (whole T: SP gathered it)
        B, T, _ = qkv.shape
        q, k, v = (
            t.view(B, T, self.local_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # [B, h, T, d]
        y = y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)
        return self.resid_drop(self.proj(y))  # [B, T, C] (or [B, T / tp, C] under SP)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.fc, self.proj = _linears(config, tp, config.n_embd, 4 * config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # hidden [B, T, 4C / tp] stays split


def _layer_norm(config: GPTConfig, tp: TensorParallel | None) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.n_embd, bias=config.bias)
    if tp is not None and tp.sequence_parallel:
        mark_sequence_parallel(norm)  # replicated weights applied to sequence shards: grads are partial
    return norm


class Block(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.ln_1 = _layer_norm(config, tp)
        self.attn = CausalSelfAttention(config, tp)
        self.ln_2 = _layer_norm(config, tp)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final norm and LM head: x -> logits [B, T, V], or [B, T, V / tp] split over the vocabulary."""

    def __init__(self, config: GPTConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.ln_f = _layer_norm(config, tp)
        if tp is None:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        else:
            # Vocab-parallel logits [B, T, V / tp]; the vocabulary is padded to a multiple of tp if needed.
            self.lm_head = ColumnParallelLinear(
                config.n_embd,
                config.vocab_size,
                bias=False,
                sequence_parallel=tp.sequence_parallel,
                group=tp.group,
                pad_out_features_to_multiple_of=1,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPTChunk(nn.Module):
    """Consecutive layers of a GPT: the embedding if `first`, blocks `layers` (global indices), the head
    if `last`. `recompute` re-runs each block's forward in backward instead of keeping its activations."""

    def __init__(
        self,
        config: GPTConfig,
        layers: range | None = None,
        *,
        first: bool = True,
        last: bool = True,
        tp: TensorParallel | None = None,
        recompute: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_tp(config, tp)
        layers = range(config.n_layer) if layers is None else layers
        if layers and not (layers.start >= 0 and layers.stop <= config.n_layer):
            raise ConfigError(f"layers {layers} are outside the model's 0..{config.n_layer - 1}")
        self.config = config
        self.tp = tp
        self.embedding = Embedding(config, tp) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(config, tp) for i in layers})
        self.head = Head(config, tp) if last else None
        self.recompute = recompute
        self.autocast_dtype = autocast_dtype

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
        return x


class GPT(GPTChunk):
    """The whole model: one chunk with every layer. Plain PyTorch unless given `tp`."""

    def __init__(self, config: GPTConfig, **kwargs) -> None:
        super().__init__(config, range(config.n_layer), first=True, last=True, **kwargs)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return GPTLoss(self.config, self.tp)(self(idx), targets)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> GPT:
        """nanoGPT's initialisation, drawn from `generator` (not the process-wide RNG)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm weights start at 1, biases at 0
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
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
    """Mean next-token cross-entropy in fp32. Under TP the logits are [B, T, V / tp] (padded vocabulary
    entries excluded) and are never gathered: the vocab-parallel loss all-reduces a max and a sum-exp."""

    def __init__(self, config: GPTConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.tp = tp

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return vocab_parallel_cross_entropy(
            logits.float(), targets, vocab_size=self.vocab_size, group=self.tp.group
        )
