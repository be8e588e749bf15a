"""The GPT's configuration: sizes, dropout, bias and the optional mixture of experts; named model sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from threadpar.errors import ConfigError
from threadpar.parallel.expert_parallel import MoEConfig


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # the longest sequence
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    # Mixture of experts: 0 keeps a dense MLP in every block; N > 0 makes each MLP N experts of its size.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None  # None: dropless
    moe_pad_to_capacity: bool = False  # every expert gets `capacity` rows, padded: fixed shapes (CUDA graphs)
    moe_aux_loss_coeff: float = 1e-2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            raise ConfigError(
                f"GPTConfig.moe_experts must be 0 (dense MLP) or a positive int, got {self.moe_experts!r}"
            )
        self.moe_config()  # MoEConfig checks the other moe_ fields

    def moe_config(self) -> MoEConfig | None:
        """The MoE layer that replaces each MLP (experts of the MLP's size), or None for dense MLPs."""
        if self.moe_experts == 0:
            return None
        return MoEConfig(
            hidden_size=self.n_embd,
            ffn_hidden_size=4 * self.n_embd,
            num_experts=self.moe_experts,
            top_k=self.moe_top_k,
            capacity_factor=self.moe_capacity_factor,
            pad_to_capacity=self.moe_pad_to_capacity,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            bias=self.bias,
        )

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=64),
    "small": GPTConfig(n_layer=8, n_head=8, n_embd=128),
    "medium": GPTConfig(n_layer=12, n_head=8, n_embd=256),
    "large": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
}


def model_config(size: str, *, block_size: int, dropout: float = 0.0, **fields) -> GPTConfig:
    """A named size with the given sequence length, dropout and other fields (e.g. moe_experts=4)."""
    if size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return replace(MODEL_SIZES[size], block_size=block_size, dropout=dropout, **fields)
