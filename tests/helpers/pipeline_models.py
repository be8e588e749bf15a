"""Small models whose pipeline chunks pass several tensors: shared by the executor tests and the
cross-process checks.

- tuple model: chunks pass (hidden fp32 [b, S, D], mask int64 [b, S], gate fp32 [b, S], residual bf16
  [b, S, D]). The mask is an integer (no gradient); the gate requires grad but only feeds a comparison
  (it gets no gradient); the residual is bf16 and does get one. Inputs are (ids, keep) and targets
  (labels, weights): tuples on the first and the last stage.
- dict model: chunks pass {"hidden", "positions" (int64), "aux" (a 0-dim loss that every block adds to),
  "scale" (a float constant), "note" (None)} as keyword arguments. Inputs and targets are dicts, and the
  last chunk returns {"logits", "aux"}.

`make_*` initialise from a private generator (the same on every rank); `my_chunks` cuts this rank's chunks
out of the layer list, and `Chain` runs layers the way the pipeline runs chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.pipeline import get_stage_info
from threadpar.pipeline.structure import call_chunk

VOCAB, DIM, SEQ = 13, 8, 3


class Chain(nn.Module):
    """Layers that each get what the previous one returned (a tuple as arguments, a dict as keywords)."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args, **kwargs):
        out = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            out = call_chunk(layer, out)
        return out


def _init(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


# the tuple model ------------------------------------------------------------------------------------------------
class TupleEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)

    def forward(self, ids, keep):
        # ids [b, S] int64, keep [b] float -> the four leaves every block passes on
        hidden = self.embedding(ids) * keep[:, None, None]
        mask = (ids % 3 != 0).long()
        return hidden, mask, hidden.mean(-1), hidden.to(torch.bfloat16)


class TupleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden, mask, gate, residual):
        x = torch.tanh(self.linear(hidden + residual.float())) * mask[..., None]
        x = x + 0.25 * (gate > 0)[..., None]  # the gate feeds a comparison only: no gradient reaches it
        return x, mask, x.mean(-1), x.to(torch.bfloat16)


class TupleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, VOCAB)

    def forward(self, hidden, mask, gate, residual):
        return self.linear(hidden + residual.float())  # logits [b, S, VOCAB]


def tuple_loss(logits, targets):
    labels, weights = targets  # [b, S] int64, [b, S] float
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (per_token * weights.flatten()).mean()


def tuple_layers(num_blocks: int, seed: int = 0) -> list[nn.Module]:
    layers = [TupleEmbed(), *[TupleBlock() for _ in range(num_blocks)], TupleHead()]
    return list(_init(nn.ModuleList(layers), seed))


def tuple_batch(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (batch, SEQ), generator=g)
    keep = torch.rand(batch, generator=g) + 0.5
    labels = torch.randint(VOCAB, (batch, SEQ), generator=g)
    return (ids, keep), (labels, torch.rand(batch, SEQ, generator=g))


# the dict model -------------------------------------------------------------------------------------------------
class DictEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(SEQ, DIM)

    def forward(self, ids, positions):
        hidden = self.embedding(ids) + self.position(positions)  # [b, S, D]
        return {
            "hidden": hidden,
            "positions": positions,
            "aux": hidden.square().mean(),
            "scale": 0.5,
            "note": None,
        }


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, *, hidden, positions, aux, scale, note):
        assert note is None and scale == 0.5 and positions.dtype == torch.int64
        hidden = torch.tanh(self.linear(hidden)) + scale * hidden
        return {
            "hidden": hidden,
            "positions": positions,
            "aux": aux + hidden.abs().mean(),
            "scale": scale,
            "note": note,
        }


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, VOCAB)

    def forward(self, *, hidden, positions, aux, scale, note):
        return {"logits": self.linear(hidden), "aux": aux}


def dict_loss(outputs, targets):
    logits = outputs["logits"]
    return F.cross_entropy(logits.flatten(0, 1), targets["labels"].flatten()) + 0.1 * outputs["aux"]


def dict_layers(num_blocks: int, seed: int = 0) -> list[nn.Module]:
    layers = [DictEmbed(), *[DictBlock() for _ in range(num_blocks)], DictHead()]
    return list(_init(nn.ModuleList(layers), seed))


def dict_batch(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (batch, SEQ), generator=g)
    positions = torch.arange(SEQ).repeat(batch, 1)
    return {"ids": ids, "positions": positions}, {"labels": torch.randint(VOCAB, (batch, SEQ), generator=g)}


MODELS = {"tuple": (tuple_layers, tuple_batch, tuple_loss), "dict": (dict_layers, dict_batch, dict_loss)}


# pipeline helpers -----------------------------------------------------------------------------------------------
def my_chunks(layers: list[nn.Module], v: int, placement: str = "loop") -> list[Chain]:
    """This rank's chunks: embedding + blocks + head cut like build_chunks does (first/last attached)."""
    pp, stage = threadpar.get_layout().pp, threadpar.get_coords().pp
    blocks = layers[1:-1]
    info = get_stage_info(len(blocks), pp, stage, v, placement)
    chunks = []
    for chunk, (start, end) in zip(info.chunk_ids, info.layer_ranges_per_chunk):
        parts = blocks[start:end]
        parts = ([layers[0]] if chunk == 0 else []) + parts + ([layers[-1]] if chunk == pp * v - 1 else [])
        chunks.append(Chain(parts))
    return chunks


def reference(kind: str, num_blocks: int, inputs, targets):
    """Loss and gradients of the whole model on the whole batch, in this thread."""
    make_layers, _, loss_fn = MODELS[kind]
    layers = make_layers(num_blocks)
    model = Chain(layers)
    loss = loss_fn(call_chunk(model, inputs), targets)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in nn.ModuleList(layers).named_parameters()}


def my_gradients(layers: list[nn.Module], chunks) -> dict[str, torch.Tensor]:
    mine = {id(p) for c in chunks for p in c.parameters()}
    return {name: p.grad for name, p in nn.ModuleList(layers).named_parameters() if id(p) in mine}
