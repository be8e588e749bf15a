"""The cuda tier's launcher: the same parity bodies as the CPU tests, on real GPUs with the nccl backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from threadpar.testing import run_ranks

# Real NCCL communicators take seconds to create on first use; the CPU tests' 20 s deadline is too tight.
GPU_TIMEOUT_S = 120.0


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_gpus(fn: Callable[..., Any], world_size: int, *args: Any, **options: Any) -> list[Any]:
    """`fn` on `world_size` GPUs (one rank thread each) with the nccl backend; `options` are launch options
    (layout, kwargs={...} for fn); a rank's error re-raised."""
    return run_ranks(fn, world_size, *args, devices=None, backend="nccl", timeout=GPU_TIMEOUT_S, **options)


def gpus_or_skip(at_least: int) -> int:
    """The number of visible GPUs, or a skip (with the reason) when there are fewer than `at_least`."""
    n = gpu_count()
    if n < at_least:
        pytest.skip(f"needs at least {at_least} GPUs with NCCL; this machine has {n}")
    return n
