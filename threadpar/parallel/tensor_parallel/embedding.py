"""Vocabulary-parallel embedding: each rank holds the rows of one contiguous range of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel.layers import check_positive_int, check_sequence_dim
from threadpar.parallel.tensor_parallel.mappings import reduce_from_tp_region, reduce_scatter_to_sp_region
from threadpar.parallel.tensor_parallel.random import INIT, get_rng_tracker
from threadpar.parallel.tensor_parallel.sharding import ShardSpec, TensorParallelModule, padded_size


class VocabParallelEmbedding(TensorParallelModule):
    """nn.Embedding split by vocabulary: rank r looks up the tokens of its range [vocab_start, vocab_end),
    writes zeros for the others, and the ranks' outputs are summed (all-reduce, or a reduce-scatter along
    `sequence_dim` with reduce_scatter_embeddings=True, which starts the sequence-parallel region).

    The vocabulary is padded so that each rank's range is a multiple of pad_vocab_to_multiple_of (so
    num_embeddings need not divide by the TP size); padded rows are zero and never looked up. Pass
    vocab_size=num_embeddings to the vocab-parallel cross-entropy to keep them out of the loss.
    padding_idx is a global token id, as in nn.Embedding: its row gets no gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        pad_vocab_to_multiple_of: int = 1,
        reduce_scatter_embeddings: bool = False,
        group: ProcessGroup | str | None = None,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        self.num_embeddings = check_positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_positive_int("embedding_dim", embedding_dim)
        if padding_idx is not None:
            if not isinstance(padding_idx, int) or not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(f"padding_idx must be a token id below num_embeddings, got {padding_idx!r}")
            padding_idx %= num_embeddings  # nn.Embedding accepts negative ids
        self.padding_idx = padding_idx
        self.reduce_scatter_embeddings = bool(reduce_scatter_embeddings)
        self.sequence_dim = check_sequence_dim(sequence_dim)
        self.padded_num_embeddings = padded_size(num_embeddings, self.tp_size, pad_vocab_to_multiple_of)
        self.pad_vocab_to_multiple_of = pad_vocab_to_multiple_of
        per_rank = self.padded_num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        # padding_idx as a row of this rank's shard, if it falls in its range
        in_range = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = (
            padding_idx - self.vocab_start if in_range and padding_idx is not None else None
        )
        self.shard_specs = {"weight": ShardSpec(0, num_embeddings, self.padded_num_embeddings)}
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Embedding's N(0, 1) of the dense table from the TP group's shared INIT stream; keep the shard."""
        if self.weight.is_meta:
            return
        generator = get_rng_tracker().generator(INIT)
        dense = torch.empty(
            self.num_embeddings, self.embedding_dim, device=generator.device, dtype=self.weight.dtype
        )
        nn.init.normal_(dense, generator=generator)
        if self.padding_idx is not None:
            dense[self.padding_idx] = 0
        self.load_dense_({"weight": dense})

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, **kwargs) -> VocabParallelEmbedding:
        """This rank's shard of `embedding` (its padding_idx, device and dtype); kwargs as the constructor's."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"VocabParallelEmbedding.from_dense needs an nn.Embedding, got {type(embedding).__name__}"
            )
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ConfigError(
                "VocabParallelEmbedding supports neither max_norm, scale_grad_by_freq nor sparse"
            )
        kwargs.setdefault("padding_idx", embedding.padding_idx)
        weight = embedding.weight
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, device="meta", dtype=weight.dtype, **kwargs
        )
        layer.to_empty(device=weight.device)
        layer.load_dense_({"weight": weight})
        layer.weight.requires_grad_(weight.requires_grad)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [batch, seq] global ids -> [batch, seq, dim] (or [batch, seq / tp, dim] reduce-scattered)
        if self.tp_size == 1:
            return F.embedding(tokens, self.weight, self.padding_idx)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        # The embedding's backward needs only the ids, so zeroing its output in place is safe.
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sp_region(out, self.group, dim=self.sequence_dim)
        return reduce_from_tp_region(out, self.group)

    def extra_repr(self) -> str:
        rs = ", reduce_scatter_embeddings=True" if self.reduce_scatter_embeddings else ""
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}{pad}, padded={self.padded_num_embeddings}, "
            f"tp={self.tp_size}, rank={self.tp_rank}, rows [{self.vocab_start}, {self.vocab_end}){rs}"
        )
