"""`MoE`: a mixture-of-experts layer whose experts are sharded over an expert-parallel (EP) group.

    x [..., hidden] -> router (top-k, aux loss) -> assignments sorted by expert, capacity applied
      -> all-to-all to the experts' ranks -> local experts (one batched matmul) -> all-to-all back
      -> sum over each token's kept assignments of gate * expert output -> y [..., hidden]

Where the EP group comes from: as in Megatron, expert parallelism is carved out of data parallelism. The
default `group=None` is this rank's DP group (ep = dp): every DP replica holds E / dp experts and sends
its tokens to the replica that holds their experts. Pass a smaller group from `expert_parallel_groups(ep)`
(ep consecutive DP ranks) or any `new_group` of ranks that see different tokens. Outside a launch, or
with a group of one, all experts are local and nothing is communicated: the single-thread MoE.

Each rank routes its own tokens, so capacity and dropping are decided per rank over the tokens of its
forward, exactly as a single-thread MoE decides them for that batch: an EP group of ep ranks computes
what ep single-thread forwards (one per rank's batch) compute. The load-balancing loss is per forward
too, unless `aux_loss_group` names the ranks that hold the rest of each sequence (the CP group): then
routing is counted over the whole sequence, as Megatron counts it over its TP x CP group, and each
rank's aux loss is its tokens' share of the whole sequence's (the shares sum to it).

The aux loss needs no code in the training loop: the backward of the layer's output also backpropagates
it, as if it had been added to the loss (Megatron's MoEAuxLossAutoScaler), so the layer is a drop-in
replacement for an MLP; `last_stats.aux_loss` has its value for logging. Because it is added in backward,
it cannot see what the loss was multiplied by before `backward()`: set `aux_loss_scale` to that factor
(1 / microbatches under gradient accumulation, an fp16 loss scale), as Megatron's set_loss_scale does.

In a CUDA graph (threadpar.graphed_step): `MoEConfig(capacity_factor=..., pad_to_capacity=True)`. Unpadded,
the number of kept assignments (a shape), the experts' row counts and the all-to-all's split sizes depend
on the routing and are read on the host, which a capture refuses (GraphCaptureError, said here before the
first host read). Padded, as Megatron's --moe-pad-expert-input-to-capacity does, every expert gets
exactly C = expert_capacity(N, ...) slots per rank (a Python int from the token count N): the kept
assignments fill a slot table [E, C] (routing.assign_slots, the same ones in the same order as `assign`),
the empty slots hold a zero row of gate 0, the experts compute [E_local, ep * C, hidden] in one bmm per
linear, the all-to-all's splits are equal, and the combine is the same index_add: the same output and
gradients as unpadded at that capacity, padding rows contributing exactly 0. `last_stats` holds device
tensors; its int/float properties read them (after the step).

Gradients: expert parameters get the gradient of every token routed to them, from the whole EP group;
replicated parameters (the router) only from this rank's tokens. Sum the router's over the DP group and
the experts' over the ranks that hold the same experts (`allreduce_moe_grads`), or wrap the model in
DistributedDataParallel, which averages both that way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from threadpar.comm.common import graph_capture
from threadpar.comm.group import ProcessGroup
from threadpar.parallel.expert_parallel.config import MoEConfig
from threadpar.parallel.expert_parallel.dispatch import AllToAllDispatcher
from threadpar.parallel.expert_parallel.experts import GroupedExperts
from threadpar.parallel.expert_parallel.routing import (
    Routing,
    TopKRouter,
    assign,
    assign_slots,
    expert_capacity,
)
from threadpar.parallel.groups import resolve_group


@dataclass
class MoEStats:
    """One forward's routing on this rank, as device tensors (the forward reads nothing on the host for
    them): routed and kept assignments per expert [E] int64, the capacity (None: dropless), dropped
    assignments and tokens that lost all their experts (int64 scalars), the aux loss (a detached scalar).
    The int and float properties read them: a host read, for after the step (in a graphed step these
    tensors are the graph's, rewritten by every replay: they hold the last replay's routing)."""

    routed: torch.Tensor
    kept: torch.Tensor
    capacity: int | None
    dropped_tensor: torch.Tensor
    dropped_tokens_tensor: torch.Tensor
    aux_loss_tensor: torch.Tensor

    @property
    def dropped(self) -> int:
        return int(self.dropped_tensor)

    @property
    def dropped_tokens(self) -> int:
        return int(self.dropped_tokens_tensor)

    @property
    def aux_loss(self) -> float:
        return float(self.aux_loss_tensor)

    @property
    def dropped_fraction(self) -> float:
        total = int(self.routed.sum())
        return self.dropped / total if total else 0.0


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the output forward; backward also backpropagates the aux loss (gradient 1)."""

    @staticmethod
    def forward(ctx, out, aux_loss):
        ctx.save_for_backward(aux_loss)
        return out

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


def resolve_ep_group(group: ProcessGroup | str | None) -> ProcessGroup | None:
    """None: this rank's DP group inside a launch, no group outside one; else the given group."""
    from threadpar.runtime.context import in_rank

    if group is None and not in_rank():
        return None
    return resolve_group(group, "DP")


def init_generator() -> torch.Generator | None:
    """The stream the layer's initial weights come from: inside a launch the TP RNG tracker's INIT
    stream (equal on all ranks of the EP and TP groups), so any ep gives the same dense experts; outside
    one the process-wide RNG, like nn.Linear."""
    from threadpar.runtime.context import in_rank

    if not in_rank():
        return None
    from threadpar.parallel.tensor_parallel.random import INIT, get_rng_tracker

    return get_rng_tracker().generator(INIT)


class MoE(nn.Module):
    """A MoE layer: `forward(x [..., hidden]) -> [..., hidden]` (see the module docstring)."""

    def __init__(
        self,
        config: MoEConfig,
        group: ProcessGroup | str | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
        aux_loss_group: ProcessGroup | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE needs a MoEConfig, got {type(config).__name__}")
        self.config = config
        group = resolve_ep_group(group)
        aux_group = None if aux_loss_group is None else resolve_group(aux_loss_group, "CP")
        self.router = TopKRouter(config, device=device, dtype=dtype, aux_loss_group=aux_group)
        self.experts = GroupedExperts(config, group, device=device, dtype=dtype)
        self.ep_size = self.experts.ep_size
        self.dispatcher = (
            AllToAllDispatcher(group, config.num_experts) if group is not None and self.ep_size > 1 else None
        )
        self.last_stats: MoEStats | None = None
        # What the training loss is multiplied by before backward; the aux loss's gradient is scaled alike
        # (a number, or a 0-dim tensor on the device, which a CUDA graph reads at each replay).
        self.aux_loss_scale: float | torch.Tensor = 1.0
        self.reset_parameters(generator if generator is not None else init_generator())

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        self.router.reset_parameters(generator)
        self.experts.reset_parameters(generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        tokens = x.reshape(-1, cfg.hidden_size)  # [N, hidden]
        n = tokens.shape[0]
        routing = self.router(tokens)
        capacity = expert_capacity(n, cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        if cfg.pad_to_capacity:
            assert capacity is not None  # (MoEConfig: pad_to_capacity needs a capacity_factor)
            y, kept, kept_ids = self._padded(tokens, routing, capacity)
        else:
            graph_capture.refuse(
                "a MoE layer without pad_to_capacity (its token counts per expert, and so its shapes, depend "
                "on the routing: read on the host)",
                "set MoEConfig(capacity_factor=..., pad_to_capacity=True): every expert then gets a fixed "
                "number of rows, padded, and the layer computes what it computes unpadded at that capacity",
            )
            y, kept, kept_ids = self._unpadded(tokens, routing, capacity)
        # Tokens with at least one kept assignment: flags scattered by the kept ids (the padded path's dummy
        # id N * k flags the extra last entry), not torch.unique (a data-dependent shape).
        flags = torch.zeros(n * cfg.top_k + 1, dtype=torch.bool, device=tokens.device)
        served = flags.index_fill(0, kept_ids, True)[:-1].view(n, cfg.top_k).any(1)
        self.last_stats = MoEStats(
            routed=routing.routed,
            kept=kept,
            capacity=capacity,
            dropped_tensor=n * cfg.top_k - kept.sum(),
            dropped_tokens_tensor=n - served.sum(),
            aux_loss_tensor=routing.aux_loss.detach(),
        )
        if cfg.aux_loss_coeff > 0 and y.requires_grad and routing.aux_loss.requires_grad:
            scale = self.aux_loss_scale  # (a number, or a tensor on the device: an fp16 loss scale, graphed)
            aux = (
                routing.aux_loss * scale
                if isinstance(scale, torch.Tensor) or scale != 1
                else routing.aux_loss
            )
            y = _AttachAuxLoss.apply(y, aux)
        return y.view(x.shape)

    def _unpadded(
        self, tokens: torch.Tensor, routing: Routing, capacity: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y [N, hidden], kept [E], the kept assignment ids [M]): only the kept rows go to the experts."""
        cfg = self.config
        order, kept = assign(routing.experts, routing.gates, cfg.num_experts, capacity, cfg.drop_policy)
        token_of = order // cfg.top_k  # [M] the token of each kept assignment, sorted by expert
        rows = tokens.index_select(0, token_of)
        if self.dispatcher is None:
            out = self.experts(rows, kept.tolist())
        else:
            out = self.dispatcher(rows, kept, self.experts)  # [M, hidden], same order as `rows`
        # Combined in the input's dtype: under autocast the experts' matmuls give low-precision rows, and
        # a token's top-k contributions are summed in the (fp32) precision of the residual stream.
        gates = routing.gates.flatten().index_select(0, order).to(tokens.dtype)
        weighted = out.to(tokens.dtype) * gates.unsqueeze(-1)
        return tokens.new_zeros(tokens.shape).index_add(0, token_of, weighted), kept, order

    def _padded(
        self, tokens: torch.Tensor, routing: Routing, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y [N, hidden], kept [E], slots [E * C]): every expert gets C rows, the empty slots a zero row of
        gate 0 (assignment id N * k: token N, one zero row past the tokens), so every shape comes from N."""
        cfg = self.config
        n, hidden = tokens.shape
        slots, kept = assign_slots(routing.experts, routing.gates, cfg.num_experts, capacity, cfg.drop_policy)
        slots = slots.flatten()  # [E * C]
        token_of = slots // cfg.top_k  # [E * C]: N for an empty slot
        padded_tokens = torch.cat([tokens, tokens.new_zeros(1, hidden)])  # [N + 1, hidden]
        rows = padded_tokens.index_select(0, token_of)
        if self.dispatcher is None:
            out = self.experts(rows.view(cfg.num_experts, capacity, hidden)).reshape(-1, hidden)
        else:
            out = self.dispatcher.padded(rows, capacity, self.experts)  # [E * C, hidden]
        gates = torch.cat([routing.gates.flatten(), routing.gates.new_zeros(1)]).index_select(0, slots)
        weighted = out.to(tokens.dtype) * gates.to(tokens.dtype).unsqueeze(-1)
        # An empty slot's row (an expert's output on zeros, times 0) goes to row N, cut off: not even a
        # non-finite output of a padding row reaches a token.
        y = tokens.new_zeros(n + 1, hidden).index_add(0, token_of, weighted)[:n]
        return y, kept, slots

    def extra_repr(self) -> str:
        cfg = self.config
        cap = "dropless" if cfg.capacity_factor is None else f"capacity_factor={cfg.capacity_factor}"
        pad = ", pad_to_capacity" if cfg.pad_to_capacity else ""
        return f"experts={cfg.num_experts}, top_k={cfg.top_k}, ep={self.ep_size}, {cap}{pad}"
