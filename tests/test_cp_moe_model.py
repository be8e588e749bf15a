"""A small language model with ring attention and MoE MLPs, trained under context parallelism (cp = 2) x
data/expert parallelism (dp = ep = 2), against the single-thread model: logits, the load-balancing loss,
every gradient and the parameters after two optimizer steps. It is the recipe a GPT needs for CP and EP:
split tokens and positions with the load-balanced layout, divide the summed token losses by the whole
batch's token count, count MoE routing over the CP group, and sum gradients over DP x CP (experts: over CP).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.tp_parity import assert_grads_close, grads_of, seed_params_
from torch import nn

import threadpar
from threadpar.parallel import (
    MoE,
    MoEConfig,
    RingAttention,
    allreduce_moe_grads,
    data_context_parallel_group,
    gather_dense_grads,
    gather_dense_state_dict,
    load_balanced_indices,
    restore_sequence_order,
    split_sequence,
)
from threadpar.testing import run_ranks

VOCAB, C, HEADS, T, LAYERS, BATCH, DP, CP = 32, 16, 2, 8, 2, 4, 2, 2
MOE = MoEConfig(hidden_size=C, ffn_hidden_size=2 * C, num_experts=4, top_k=2, aux_loss_coeff=0.1)


class Block(nn.Module):
    def __init__(self, parallel):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        # parallel: ring attention over this rank's CP group; experts over its DP group, routing counted over CP
        self.ring = RingAttention() if parallel else None
        self.moe = MoE(MOE, aux_loss_group="CP") if parallel else MoE(MOE)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(self.ln_1(x)).chunk(3, dim=-1))
        y = self.ring(q, k, v) if self.ring else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, C))
        return x + self.moe(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self, parallel=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, C), nn.Embedding(T, C)
        self.blocks = nn.Sequential(*(Block(parallel) for _ in range(LAYERS)))
        self.ln_f, self.head = nn.LayerNorm(C), nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx, positions):  # idx [B, t] -> logits [B, t, VOCAB]
        return self.head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(positions))))


def train(model, shards, positions, sync=lambda m: None, grads=grads_of, steps=2):
    """SGD on the mean token loss of the whole batch, built from `shards` [(idx, targets)] as the sum of
    their token losses / the batch's token count. Returns the first step's logits, aux losses, gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        logits, aux = [], []
        for idx, targets in shards:
            out = model(idx, positions)
            F.cross_entropy(out.flatten(0, 1), targets.flatten(), reduction="sum").div(BATCH * T).backward()
            logits.append(out.detach())
            aux.append([block.moe.last_stats.aux_loss for block in model.blocks])
        sync(model)
        if step == 0:
            first = logits, aux, grads(model)
        opt.step()
    return first


def test_tiny_lm_with_ring_attention_and_moe_under_cp_and_ep_matches_one_thread():
    dense = seed_params_(TinyLM(), seed=5)
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(VOCAB, (BATCH, T), generator=g)
    targets = torch.randint(VOCAB, (BATCH, T), generator=g)
    rows = BATCH // DP
    shards = [(idx[d * rows : (d + 1) * rows], targets[d * rows : (d + 1) * rows]) for d in range(DP)]
    # One thread, all experts, one DP shard after the other (each shard is one MoE forward, as on a DP
    # rank), gradients accumulated.
    reference = copy.deepcopy(dense)
    want_logits, want_aux, want_grads = train(reference, shards, torch.arange(T))

    def body():
        coords = threadpar.get_coords()
        model = TinyLM(parallel=True)
        model.load_state_dict(dense.state_dict())  # the dense experts are split over the EP (= DP) group
        idx_d, targets_d = shards[coords.dp]
        local = [(split_sequence(idx_d, dim=1), split_sequence(targets_d, dim=1))]
        positions = load_balanced_indices(T, CP, coords.cp)
        dp_cp = data_context_parallel_group()

        def sync(m):  # replicated parameters over DP x CP; experts over CP (the ranks holding the same ones)
            allreduce_moe_grads(m, dp_group=dp_cp, expert_dp_group=threadpar.get_group("CP"))

        (logits,), (aux,), grads = train(model, local, positions, sync, gather_dense_grads, steps=1)
        train(model, local, positions, sync, steps=1)
        return coords, logits, aux, grads, gather_dense_state_dict(model)

    results = run_ranks(body, DP * CP, cp=CP)
    for d in range(DP):
        mine = sorted((r for r in results if r[0].dp == d), key=lambda r: r[0].cp)
        logits = restore_sequence_order(torch.cat([r[1] for r in mine], dim=1), CP, dim=1)
        torch.testing.assert_close(logits, want_logits[d])
        for layer in range(LAYERS):  # each CP rank's aux loss is its share of the whole sequence's
            assert sum(r[2][layer] for r in mine) == pytest.approx(want_aux[d][layer], rel=1e-6)
    for _, _, _, grads, state in results:
        assert_grads_close(grads, want_grads)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(
                state[name], value, msg=lambda m, name=name: f"{name} after steps: {m}"
            )
