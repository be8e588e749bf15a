"""The experts of a MoE layer as stacked weights, computed together with batched matmuls.

Expert e is the MLP  y = act(x @ fc1_weight[e] + fc1_bias[e]) @ fc2_weight[e] + fc2_bias[e]  with
fc1_weight [E, hidden, ffn] and fc2_weight [E, ffn, hidden] (input-major, so no transposes in the bmm).
Under expert parallelism each rank of the EP group holds E / ep consecutive experts: the parameters are
split along dim 0, with the same ShardSpec machinery as the TP layers, so `load_state_dict` accepts the
dense [E, ...] tensors and `gather_dense_state_dict` / `gather_dense_grads` rebuild them.

The local experts run as one batched matmul over experts (Megatron's GroupedMLP does a grouped GEMM):
their tokens arrive grouped by expert with different counts, so they are padded to the largest count,
[E_local, max_count, hidden], when the counts differ. Padded to capacity (MoEConfig.pad_to_capacity) they
arrive as [E_local, rows, hidden] already: one bmm per linear, no counts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.expert_parallel.config import ACTIVATIONS, MoEConfig
from threadpar.parallel.tensor_parallel.sharding import ShardSpec, TensorParallelModule

PARAMS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


class GroupedExperts(TensorParallelModule):
    """This rank's E / ep experts. `group`: the EP group (None: all E experts here, no group)."""

    fc1_weight: nn.Parameter  # [E / ep, hidden, ffn]
    fc1_bias: nn.Parameter | None  # [E / ep, ffn]
    fc2_weight: nn.Parameter  # [E / ep, ffn, hidden]
    fc2_bias: nn.Parameter | None  # [E / ep, hidden]

    def __init__(self, config: MoEConfig, group: ProcessGroup | None, device=None, dtype=None) -> None:
        if group is None:  # a plain module: outside a launch, or no expert parallelism
            nn.Module.__init__(self)
            # No group at all (the TP layers always have one): only read where ep_size > 1.
            self.group, self.tp_size, self.tp_rank, self.shard_specs = None, 1, 0, {}  # type: ignore[assignment]
        else:
            super().__init__(group)
        self.config = config
        E, ep = config.num_experts, self.tp_size
        if E % ep:
            raise ConfigError(
                f"num_experts={E} is not divisible by the expert-parallel size {ep}; pick a multiple of {ep}"
            )
        self.num_local_experts = E // ep
        self.activation = ACTIVATIONS[config.activation]
        h, f, n = config.hidden_size, config.ffn_hidden_size, self.num_local_experts
        shapes = {"fc1_weight": (n, h, f), "fc1_bias": (n, f), "fc2_weight": (n, f, h), "fc2_bias": (n, h)}
        for name in PARAMS:
            if config.bias or name.endswith("weight"):
                setattr(self, name, nn.Parameter(torch.empty(shapes[name], device=device, dtype=dtype)))
                if group is not None:
                    self.shard_specs[name] = ShardSpec(0, E, E)
            else:
                self.register_parameter(name, None)

    @property
    def ep_size(self) -> int:
        return self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Every expert initialised as nn.Linear would be, drawn densely for all E experts from `generator`
        (None: the process-wide RNG); this rank keeps its own, so any ep gives the same experts."""
        cfg = self.config
        if self.fc1_weight.is_meta:
            return
        like: dict[str, Any] = {"dtype": self.fc1_weight.dtype, "device": self.fc1_weight.device}
        if generator is not None:
            like["device"] = generator.device
        dense = {}
        for name in PARAMS:
            if getattr(self, name) is None:
                continue
            fan_in = cfg.hidden_size if name.startswith("fc1") else cfg.ffn_hidden_size
            bound = 1.0 / math.sqrt(fan_in)
            shape = (cfg.num_experts, *getattr(self, name).shape[1:])
            dense[name] = torch.empty(shape, **like).uniform_(-bound, bound, generator=generator)
        with torch.no_grad():
            first = self.ep_rank * self.num_local_experts
            for name, full in dense.items():
                getattr(self, name).copy_(full[first : first + self.num_local_experts])

    def forward(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """x [R, hidden]: rows grouped by local expert, counts[e] rows for expert e -> outputs [R, hidden].
        counts None: x [E_local, rows, hidden], each expert's rows (padded to capacity) -> [E_local, rows, hidden]."""
        if counts is None:
            return self._mlp(x)
        n, hidden = self.num_local_experts, x.shape[-1]
        width = max(counts, default=0)
        padded = any(c != width for c in counts)
        if padded:
            counts_t = torch.tensor(counts, device=x.device)
            expert_of_row = torch.repeat_interleave(torch.arange(n, device=x.device), counts_t)  # [R]
            starts = counts_t.cumsum(0) - counts_t
            slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of_row]
            where = expert_of_row * width + slot  # each row's place in the padded [n * width] rows
            x = x.new_zeros(n * width, hidden).index_copy(0, where, x)
        h = self._mlp(x.view(n, width, hidden)).reshape(n * width, hidden)
        return h.index_select(0, where) if padded else h

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [E_local, rows, hidden] -> [E_local, rows, hidden]: every local expert on its rows, batched."""
        h = self._linear(x, self.fc1_weight, self.fc1_bias)  # [n, rows, ffn]
        return self._linear(self.activation(h), self.fc2_weight, self.fc2_bias)  # [n, rows, hidden]

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, weight)

    def extra_repr(self) -> str:
        cfg = self.config
        return (
            f"experts {self.ep_rank * self.num_local_experts}..{(self.ep_rank + 1) * self.num_local_experts - 1} "
            f"of {cfg.num_experts}, hidden={cfg.hidden_size}, ffn={cfg.ffn_hidden_size}, ep={self.ep_size}"
        )
