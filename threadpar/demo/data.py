"""The demo's data: byte-level tokens from a text file, or a synthetic corpus generated in code.

Batches are a pure function of (seed, step): every rank computes the same global batch and takes its
data-parallel slice, so any (dp, tp, pp) layout trains on exactly the same tokens, and a run resumed at
step s continues the stream where the interrupted run would have. The data position is just the step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from threadpar.errors import ConfigError
from threadpar.runtime.rng import derive_seed

VOCAB_SIZE = 256  # byte-level tokens

_SUBJECTS = [
    "the cat",
    "a dog",
    "my friend",
    "the old man",
    "a small bird",
    "the teacher",
    "our team",
    "she",
    "he",
]
_VERBS = ["sees", "likes", "finds", "paints", "follows", "carries", "remembers", "builds", "reads"]
_OBJECTS = [
    "the red ball",
    "a long letter",
    "the river",
    "a quiet house",
    "the blue door",
    "an apple",
    "the map",
]
_PLACES = ["in the park", "at home", "by the sea", "near the station", "under the tree", "after school"]


def synthetic_corpus(num_bytes: int = 1 << 20, seed: int = 1234) -> bytes:
    """Sentences from a small grammar plus counting and arithmetic lines: structure a small GPT can learn
    quickly (word spellings, grammar, digits that follow rules), so the loss falls far below ln(256)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < num_bytes:
        kind = rng.random()
        if kind < 0.6:
            line = (
                f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
            )
        elif kind < 0.8:
            start = rng.randrange(0, 90)
            line = "count: " + " ".join(str(start + i) for i in range(rng.randrange(3, 8)))
        else:
            a, b = rng.randrange(0, 50), rng.randrange(0, 50)
            line = f"{a} + {b} = {a + b}"
        out.append(line)
        size += len(line) + 1
    return ("\n".join(out) + "\n").encode()[:num_bytes]


def load_tokens(path: str | Path | None, seed: int = 1234) -> torch.Tensor:
    """A 1-D uint8 tensor of byte tokens: the file at `path`, or the synthetic corpus."""
    if path is None:
        data = synthetic_corpus(seed=seed)
    else:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--data {path}: no such file; give a text file (its bytes are the tokens)")
        data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class Batches:
    """The stream of global batches: `batch(step)` -> (inputs, targets), each [batch_size, seq_len] int64."""

    tokens: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        if self.tokens.numel() < self.seq_len + 2:
            raise ConfigError(
                f"the corpus has {self.tokens.numel()} tokens, too few for seq_len={self.seq_len}; "
                "use a larger --data file or a smaller --seq-len"
            )

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, "batch", step))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)  # [batch, seq_len + 1]
        window = self.tokens[idx].long()
        return window[:, :-1], window[:, 1:]


def data_parallel_slice(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This replica's contiguous share of the global batch (dim 0)."""
    if batch.shape[0] % dp_size:
        raise ConfigError(
            f"batch size {batch.shape[0]} is not divisible by dp={dp_size}; choose a multiple of {dp_size}"
        )
    per = batch.shape[0] // dp_size
    return batch[dp_rank * per : (dp_rank + 1) * per]
