"""One rank's tensor-parallel RNG tracker: named torch.Generators whose seeds say which ranks share a stream.

The streams and why they exist are described in threadpar.parallel.tensor_parallel.random, which draws
dropout masks and initial weights from them. The tracker is per-rank state, so it lives in the rank's
RankContext (`RankContext.rng_tracker`, made with the context): never in a module global (DESIGN.md rule 1).
"""

from __future__ import annotations

import torch

from threadpar.runtime.rng import derive_seed, make_generator
from threadpar.topology import Coords

TP_REGION = "tensor-parallel-region"
REPLICATED = "replicated"
INIT = "init"
_PER_TP_RANK = {TP_REGION}


class RNGTracker:
    """One rank's named generators (created on first use); the streams are described in threadpar.parallel.tensor_parallel.random."""

    def __init__(self, base_seed: int, coords: Coords, device: torch.device) -> None:
        self._base_seed = base_seed
        self._coords = coords
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def seed(self, name: str) -> int:
        keys: tuple[str | int, ...] = ("tp-rng", name, self._coords.pp)
        if name != INIT:  # CP ranks hold replicas of one model (same init) but different tokens (masks)
            keys += (self._coords.cp,)
        if name in _PER_TP_RANK:
            keys += (self._coords.tp,)
        return derive_seed(self._base_seed, *keys)

    def generator(self, name: str = REPLICATED) -> torch.Generator:
        gen = self._generators.get(name)
        if gen is None:
            gen = self._generators[name] = make_generator(self.device, self.seed(name))
        return gen

    def generators(self) -> list[torch.Generator]:
        """Every generator made so far (a CUDA graph registers them before capture)."""
        return list(self._generators.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generators' states, for a checkpoint (each rank saves its own)."""
        return {name: gen.get_state() for name, gen in self._generators.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        for name, state in states.items():
            self.generator(name).set_state(state)
