"""Per-rank random generators.

`torch.manual_seed` seeds one CPU generator shared by every thread of the process, so threadpar gives each
rank its own `torch.Generator`, seeded from the launch's base seed and keys such as the rank.
"""

from __future__ import annotations

import functools

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(base_seed: int, *keys: int | str) -> int:
    """A well-mixed 63-bit seed from a base seed and keys; different keys give unrelated streams."""
    x = _splitmix64(base_seed & _MASK64)
    for key in keys:
        if isinstance(key, str):
            key = int.from_bytes(key.encode(), "little") & _MASK64
        x = _splitmix64(x ^ (key & _MASK64))
    return x & ((1 << 63) - 1)


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on `device`, seeded. A PrivateUse1 backend registered from Python cannot make generators
    (torch/csrc/acc/Module.cpp leaves the hooks' getNewGenerator to the base, which raises): its ranks get a
    host generator, which such a backend's random ops take (the CUDA double's do: tests/fakes/sim_gpu.py)."""
    generator = torch.Generator(device=device if _makes_generators(device.type) else "cpu")
    generator.manual_seed(seed)
    return generator


@functools.lru_cache
def _makes_generators(device_type: str) -> bool:
    if device_type != torch._C._get_privateuse1_backend_name():
        return True
    try:
        torch.Generator(device=device_type)
    except (RuntimeError, NotImplementedError):
        return False
    return True
