"""torch.autocast on the double's device (`torch.autocast("simgpu", ...)`), with CUDA's cast policy.

torch keeps autocast's kernels in C++, one dispatch key per device type (aten/src/ATen/autocast_mode.cpp), and
registers none for PrivateUse1: a backend brings its own (autocast_mode.h, KERNEL_PRIVATEUSEONE), else every op
under autocast fails ("Could not run ... with arguments from the 'Autocastsimgpu' backend"). So the double
registers Python kernels on AutocastPrivateUse1 for the ops of CUDA's lists (autocast_mode.h: the AT_FORALL_*
macros that autocast_mode.cpp registers for CUDA), each applying its policy as autocast_mode.h's WrapFunction_
does, and a fallthrough for every other op (autocast_mode.cpp: `TORCH_LIBRARY_IMPL(_, Autocast, m)`):
- lower_precision_fp: floating device tensors (not float64: is_eligible) cast to the autocast dtype;
- fp32: cast to float32;
- fp32_set_opt_dtype: the op's `dtype` argument set to float32 when not given and the first argument is
  eligible;
- fp32_append_dtype (norm): redispatched to the overload that takes a dtype, float32 for an eligible input;
- promote: all eligible arguments cast to the widest floating type among them (autocast_mode.h, prioritize);
- binary_cross_entropy: refused, as torch refuses it.
Each kernel runs its op with autocast excluded (WrapFunction_'s ExcludeDispatchKeyGuard), above autograd, so the
casts are recorded for backward as on CUDA. Not modelled: the cache of fp32 weights' casts (cached_cast), which
saves work, not values.
"""

from __future__ import annotations

from typing import Any

import torch

_KEY = "AutocastPrivateUse1"

# autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP
_LOWER = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
# AT_FORALL_FP32
_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
# AT_FORALL_FP32_SET_OPT_DTYPE (without the named-tensor overloads: Dimname; this torch builds none)
_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: registered overload -> the overload it redispatches to with a dtype
# (norm.names_ScalarOpt_dim: named tensors, not built)
_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# AT_FORALL_PROMOTE
_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)  # fmt: skip

# autocast_mode.cpp, binary_cross_entropy_banned: refused under autocast on every device
_BCE_BANNED = (
    "binary_cross_entropy (F.binary_cross_entropy, nn.BCELoss) is unsafe to autocast (torch refuses it: "
    "autocast_mode.cpp); use binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss) on the logits instead"
)

_libraries: list[torch.library.Library] = []


def register(device_type: str) -> None:
    """Autocast kernels for the PrivateUse1 device named `device_type` (once per process: sim_gpu.install)."""
    lib = torch.library.Library("aten", "IMPL")
    for name in _LOWER:
        _impl(lib, name, _lower_precision(device_type))
    for name in _FP32:
        _impl(lib, name, _fp32(device_type))
    for name in _FP32_SET_OPT_DTYPE:
        _impl(lib, name, _fp32_set_opt_dtype(device_type))
    for name, target in _FP32_APPEND_DTYPE.items():
        _impl(lib, name, _fp32_append_dtype(device_type, _overload(target)))
    for name in _PROMOTE:
        _impl(lib, name, _promote(device_type))
    lib.impl("binary_cross_entropy", _banned, _KEY, with_keyset=True)
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    _libraries.extend([lib, fallthrough])


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _impl(lib: torch.library.Library, name: str, policy: Any) -> None:
    op = _overload(name)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            return policy(op, args, kwargs)

    lib.impl(name, kernel, _KEY, with_keyset=True)


def _no_autocast() -> Any:
    # WrapFunction_: ExcludeDispatchKeyGuard(AutocastFunctionality), every device type's autocast key
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
    for name in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastIPU"):
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    return torch._C._ExcludeDispatchKeyGuard(keys)


def _eligible(value: Any, device_type: str) -> bool:
    """autocast_mode.h, is_eligible: a floating tensor of the autocast's device type, not float64."""
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == device_type
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


def _cast(value: Any, to: torch.dtype, device_type: str) -> Any:
    """cached_cast, for a tensor, an optional one, or a list of them (without the cache)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, to, device_type) for v in value)
    if _eligible(value, device_type) and value.dtype != to:
        return value.to(to)
    return value


def _cast_all(op: Any, args: tuple, kwargs: dict, to: torch.dtype, device_type: str) -> Any:
    args = tuple(_cast(a, to, device_type) for a in args)
    kwargs = {k: _cast(v, to, device_type) for k, v in kwargs.items()}
    return op(*args, **kwargs)


def _lower_precision(device_type: str) -> Any:
    def policy(op: Any, args: tuple, kwargs: dict) -> Any:
        return _cast_all(op, args, kwargs, torch.get_autocast_dtype(device_type), device_type)

    return policy


def _fp32(device_type: str) -> Any:
    def policy(op: Any, args: tuple, kwargs: dict) -> Any:
        return _cast_all(op, args, kwargs, torch.float32, device_type)

    return policy


def _fp32_set_opt_dtype(device_type: str) -> Any:
    def policy(op: Any, args: tuple, kwargs: dict) -> Any:
        if not (args and _eligible(args[0], device_type)):
            return op(*args, **kwargs)  # (ineligible: unaltered, as WrapFunction_ leaves it)
        position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
        if position < len(args):
            if args[position] is None:
                args = (*args[:position], torch.float32, *args[position + 1 :])
        elif kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
        return op(*args, **kwargs)

    return policy


def _fp32_append_dtype(device_type: str, target: Any) -> Any:
    def policy(op: Any, args: tuple, kwargs: dict) -> Any:
        first = args[0]
        out_type = torch.float32 if _eligible(first, device_type) else first.dtype  # type_from_firstarg
        return target(*args, **kwargs, dtype=out_type)

    return policy


def _promote(device_type: str) -> Any:
    def policy(op: Any, args: tuple, kwargs: dict) -> Any:
        lower = torch.get_autocast_dtype(device_type)
        current = lower
        for value in [*args, *kwargs.values()]:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                # prioritize: float32 wins over the lower precision; float64 is ignored
                if _eligible(t, device_type) and t.dtype == torch.float32:
                    current = torch.float32
        return _cast_all(op, args, kwargs, current, device_type)

    return policy


def _banned(keyset: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(_BCE_BANNED)
