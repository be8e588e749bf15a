"""Helpers of the tensor-parallel parity tests: seeded dense models, reference gradients, comparisons.

The oracle: a dense model runs on the test's own thread; each rank builds the TP model from it
(from_dense / parallelize), runs the same data, and returns its output and dense-gathered gradients.
"""

from __future__ import annotations

import copy
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

import threadpar


def seed_params_(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic, well-scaled values for every parameter (norm weights near 1), from a local generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            elif name.endswith("weight"):  # a norm's scale
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)
    return module


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def tp_coords() -> tuple[int, int]:
    """(this rank's index in its TP group, the TP size)."""
    group = threadpar.get_group("TP")
    return group.rank(), group.size()


def my_chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's 1/tp of a dense tensor along dim (what sequence parallelism hands it)."""
    rank, tp = tp_coords()
    return x.chunk(tp, dim)[rank].contiguous()


def assert_grads_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys(), f"parameter names differ: {sorted(got)} vs {sorted(want)}"
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(
                got[name], g, msg=lambda m, name=name: f"gradient of {name}: {m}", **tol
            )


class MLPBlock(nn.Module):
    """Pre-norm MLP with a residual: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self, ln, fc1, fc2):
        super().__init__()
        self.ln, self.fc1, self.fc2 = ln, fc1, fc2

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def dense_mlp_block(hidden: int, ffn: int, seed: int = 1) -> MLPBlock:
    block = MLPBlock(nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
    seed_params_(block, seed)
    return block


def tp_mlp_block(dense: MLPBlock, sp: bool, **column_options) -> MLPBlock:
    """This rank's TP version of `dense` (fc1 column-, fc2 row-parallel; the norm marked under SP)."""
    from threadpar.parallel import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel

    block = MLPBlock(
        copy.deepcopy(dense.ln),
        ColumnParallelLinear.from_dense(dense.fc1, sequence_parallel=sp, **column_options),
        RowParallelLinear.from_dense(dense.fc2, sequence_parallel=sp),
    )
    if sp:
        mark_sequence_parallel(block.ln)
    return block


def backward_off_the_rank_thread(loss: torch.Tensor) -> None:
    """loss.backward() on a plain thread the rank starts: no rank context there, as on torch's device
    threads on CUDA. Its error is re-raised here, on the rank thread."""
    errors = []

    def backward():
        try:
            assert not threadpar.in_rank()
            loss.backward()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
