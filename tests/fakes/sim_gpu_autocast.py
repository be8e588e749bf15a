"""Autocast on the double's GPUs, as CUDA autocasts.

torch registers autocast kernels per device key: AutocastCUDA's cast matmuls to the autocast dtype, reductions
and losses to float32 (aten/src/ATen/autocast_mode.cpp, from the op lists of aten/src/ATen/autocast_mode.h, whose
comment says they are there "to make sure other backends can reuse the policy op list"); AutocastPrivateUse1
gets a fallthrough, and a backend registers its own. So the double registers, on AutocastPrivateUse1, CUDA's
policies for CUDA's lists (`register`), as autocast_mode.h's WrapFunction_ applies them:
- lower_precision_fp: floating tensors on the device (not float64) cast to the autocast dtype (`cached_cast`);
- fp32: such tensors cast to float32;
- fp32_set_opt_dtype: if the first argument is such a tensor, the op's `dtype` set to float32;
- promote: such tensors cast to the widest floating type among them (`promote_type`).
Not modelled: the cache of casts of leaf weights within an autocast region (autocast_mode.cpp, cached_casts: the
same values, cast once), and the `norm` overloads that append a dtype (fp32_append_dtype).
"""

from __future__ import annotations

from typing import Any

import torch

# aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE,
# AT_FORALL_PROMOTE (op, overload; "" is the default overload)
LOWER_PRECISION_FP = (
    ("_convolution", "deprecated"), ("_convolution", ""), ("conv1d", ""), ("conv2d", ""), ("conv3d", ""),
    ("conv_tbc", ""), ("conv_transpose1d", ""), ("conv_transpose2d", "input"), ("conv_transpose3d", "input"),
    ("convolution", ""), ("prelu", ""), ("addmm", ""), ("addmv", ""), ("addr", ""), ("matmul", ""),
    ("einsum", ""), ("mm", ""), ("mv", ""), ("linalg_vecdot", ""), ("linear", ""), ("addbmm", ""),
    ("baddbmm", ""), ("bmm", ""), ("chain_matmul", ""), ("linalg_multi_dot", ""), ("_thnn_fused_lstm_cell", ""),
    ("_thnn_fused_gru_cell", ""), ("lstm_cell", ""), ("gru_cell", ""), ("rnn_tanh_cell", ""),
    ("rnn_relu_cell", ""), ("_scaled_dot_product_flash_attention", ""), ("scaled_dot_product_attention", ""),
)  # fmt: skip
FP32 = (
    ("acos", ""), ("asin", ""), ("cosh", ""), ("erfinv", ""), ("exp", ""), ("expm1", ""), ("log", ""),
    ("log10", ""), ("log2", ""), ("log1p", ""), ("reciprocal", ""), ("rsqrt", ""), ("sinh", ""), ("tan", ""),
    ("pow", "Tensor_Scalar"), ("pow", "Tensor_Tensor"), ("pow", "Scalar"), ("softplus", ""), ("layer_norm", ""),
    ("native_layer_norm", ""), ("group_norm", ""), ("frobenius_norm", "dim"), ("nuclear_norm", ""),
    ("nuclear_norm", "dim"), ("cosine_similarity", ""), ("poisson_nll_loss", ""), ("cosine_embedding_loss", ""),
    ("nll_loss", ""), ("nll_loss2d", ""), ("hinge_embedding_loss", ""), ("kl_div", ""), ("l1_loss", ""),
    ("smooth_l1_loss", ""), ("huber_loss", ""), ("mse_loss", ""), ("margin_ranking_loss", ""),
    ("multilabel_margin_loss", ""), ("soft_margin_loss", ""), ("triplet_margin_loss", ""),
    ("multi_margin_loss", ""), ("binary_cross_entropy_with_logits", ""), ("dist", ""), ("pdist", ""),
    ("cdist", ""), ("renorm", ""), ("logsumexp", ""), ("upsample_nearest1d", ""), ("_upsample_nearest_exact1d", ""),
    ("upsample_nearest2d", ""), ("_upsample_nearest_exact2d", ""), ("upsample_nearest3d", ""),
    ("_upsample_nearest_exact3d", ""), ("upsample_linear1d", ""), ("upsample_bilinear2d", ""),
    ("_upsample_bilinear2d_aa", ""), ("upsample_trilinear3d", ""), ("upsample_bicubic2d", ""),
    ("_upsample_bicubic2d_aa", ""),
)  # fmt: skip
FP32_SET_OPT_DTYPE = (
    ("prod", ""), ("prod", "dim_int"), ("softmax", "int"), ("log_softmax", "int"), ("cumprod", ""),
    ("cumsum", ""), ("linalg_vector_norm", ""), ("linalg_matrix_norm", ""), ("linalg_matrix_norm", "str_ord"),
    ("sum", ""), ("sum", "dim_IntList"),
)  # fmt: skip
PROMOTE = (
    ("addcdiv", ""), ("addcmul", ""), ("atan2", ""), ("bilinear", ""), ("cross", ""), ("dot", ""), ("vdot", ""),
    ("grid_sampler", ""), ("index_put", ""), ("tensordot", ""), ("scatter_add", ""),
)  # fmt: skip

_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(t: Any, device_type: str) -> bool:
    """autocast_mode.h, is_autocast_eligible: a floating tensor (not float64) on the autocast device type."""
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == device_type
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cast(value: Any, dtype: torch.dtype, device_type: str) -> Any:
    if _eligible(value, device_type):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, device_type) for v in value)
    return value


def _kernel(op: Any, policy: str, device_type: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY):
            if policy == "lower":
                low = torch.get_autocast_dtype(device_type)
                args, kwargs = _cast(args, low, device_type), _cast(kwargs, low, device_type)
            elif policy == "fp32":
                args, kwargs = (
                    _cast(args, torch.float32, device_type),
                    _cast(kwargs, torch.float32, device_type),
                )
            elif policy == "set_opt_dtype":
                if args and _eligible(args[0], device_type):
                    kwargs = {**kwargs, "dtype": torch.float32}
            else:  # promote: autocast_mode.h promote_type, the widest floating type of the eligible arguments
                widest = torch.get_autocast_dtype(device_type)
                for t in [*args, *kwargs.values()]:
                    if _eligible(t, device_type):
                        widest = torch.promote_types(widest, t.dtype)
                args, kwargs = _cast(args, widest, device_type), _cast(kwargs, widest, device_type)
            return op(*args, **kwargs)

    return call


def register(lib: Any, device_type: str) -> list[Any]:
    """CUDA's autocast policies, for CUDA's op lists, on the AutocastPrivateUse1 key of `lib` (aten IMPL); every
    other op falls through the key, as autocast_mode.cpp's `TORCH_LIBRARY_IMPL(_, AutocastCUDA, m)` makes them
    (a fallthrough fallback). Returns the libraries to keep alive."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for policy, ops in (
        ("lower", LOWER_PRECISION_FP),
        ("fp32", FP32),
        ("set_opt_dtype", FP32_SET_OPT_DTYPE),
        ("promote", PROMOTE),
    ):
        for name, overload in ops:
            packet = getattr(torch.ops.aten, name, None)
            op = None if packet is None else getattr(packet, overload or "default", None)
            if op is None:  # (an op this torch does not have)
                continue
            qualified = name if not overload else f"{name}.{overload}"
            lib.impl(qualified, _kernel(op, policy, device_type), "AutocastPrivateUse1")
    return [fallback]
