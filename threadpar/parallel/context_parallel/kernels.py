"""Attention of one block of queries on one block of keys, with the log-sum-exp of every query's scores.

Ring attention needs, for each block, the output *and* the log-sum-exp (LSE) of the scaled scores, to merge
blocks exactly; and in backward, the block's gradients given the *final* output and LSE (then the
softmax probabilities it recomputes are the global ones, and the block gradients sum to the exact ones).
F.scaled_dot_product_attention returns neither, so two kernels implement both directions:

- "flash": PyTorch's fused CPU flash-attention kernels (aten::_scaled_dot_product_flash_attention_for_cpu
  and its backward): tiled, no [Sq, Sk] score matrix in memory.
- "math": plain matmuls that hold the [Sq, Sk] scores; any device and dtype. It is the reference the
  flash kernel is tested against, and what runs on CUDA for now (the CUDA flash kernels' LSE and RNG
  arguments differ; they need a GPU to be validated).

Shapes: q [B, H, Sq, D], k and v [B, H, Sk, D]; out [B, H, Sq, D]; lse [B, H, Sq] (float32, or float64
for float64 inputs). `causal` masks key j > query i within the block (used on square blocks only).
"""

from __future__ import annotations

import torch

from threadpar.errors import ConfigError

KERNELS = ("auto", "flash", "math")


def pick_kernel(kernel: str, device: torch.device) -> str:
    if kernel not in KERNELS:
        raise ConfigError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if kernel == "auto":
        return "flash" if device.type == "cpu" else "math"
    if kernel == "flash" and device.type != "cpu":
        raise ConfigError(
            f"kernel='flash' runs on CPU tensors only (got {device.type}); use kernel='auto' or 'math'"
        )
    return kernel


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """True where the key comes after the query (masked out)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)  # [B, H, Sq, Sk]
    if causal:
        s.masked_fill_(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


def math_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype), lse


def math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    s = _scores(q, k, causal, scale)
    p = s.sub_(lse.to(s.dtype).unsqueeze(-1)).exp_()  # the global softmax probabilities of this block
    acc = p.dtype
    dout_, v_ = dout.to(acc), v.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), dout_)
    # dS = P * (dP - rowsum(dO * O)), with O the final output: the softmax Jacobian of the whole row
    delta = (dout_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p.mul_(torch.matmul(dout_, v_.transpose(-1, -2)).sub_(delta)).mul_(scale)
    dq = torch.matmul(ds, k.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale
    )


FORWARD = {"flash": flash_forward, "math": math_forward}
BACKWARD = {"flash": flash_backward, "math": math_backward}
