"""torch's DistributedDataParallel parameters that threadpar's DDP takes in torch's order, and what they mean here.

Mirrors torch/nn/parallel/distributed.py (DistributedDataParallel.__init__, torch 2.13): `device_ids` is one
CUDA device (a list of one) for a module on that device, and must be None for a CPU module; `output_device`
defaults to device_ids[0]; with device_ids, forward moves its tensor inputs to that device. Here that device
must be the rank's own. Options that change what DDP computes and threadpar's DDP does not implement raise
a ConfigError instead of being ignored; pure performance hints of torch's reducer (static_graph,
batched_grad_copy) do not change results and are accepted.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from threadpar.comm.common.gpu import is_gpu
from threadpar.errors import ConfigError


def _index(value: object, what: str) -> int:
    """A GPU device index from an int or a torch.device/str (torch's _get_device_index)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise ConfigError(f"DistributedDataParallel: {what}={value!r} names no device") from None
    if not is_gpu(device) or device.index is None:
        raise ConfigError(f"DistributedDataParallel: {what}={value!r} is not a GPU device with an index")
    return device.index


def resolve_device_ids(
    module: nn.Module, device_ids: Sequence[Any] | None, output_device: Any, rank_device: torch.device
) -> torch.device | None:
    """The device forward moves inputs to (None: no moving), after torch's checks and threadpar's one: the
    device must be this rank's (threadpar.get_device())."""
    devices = {p.device for p in module.parameters()}
    if device_ids is not None and len(device_ids) > 1:
        raise ConfigError(
            f"DistributedDataParallel: device_ids={list(device_ids)} names several devices; a rank thread "
            f"drives one: pass device_ids={_expected(rank_device)}"
        )
    if not device_ids or rank_device.type == "cpu" or len(devices) > 1:
        if device_ids or output_device is not None:
            raise ConfigError(
                f"DistributedDataParallel: device_ids={device_ids!r} and output_device={output_device!r} are for "
                f"a module on one CUDA device; this module's parameters are on {sorted(map(str, devices))}: "
                "pass device_ids=None (as torch requires for CPU and multi-device modules)"
            )
        return None
    index = _index(device_ids[0], "device_ids")
    if index != rank_device.index:
        raise ConfigError(
            f"DistributedDataParallel: device_ids={list(device_ids)} but this rank's device is {rank_device}; "
            f"pass device_ids={_expected(rank_device)} (threadpar.get_device()), or None"
        )
    if output_device is not None and _index(output_device, "output_device") != index:
        raise ConfigError(
            f"DistributedDataParallel: output_device={output_device!r} is not device_ids[0] ({rank_device}); "
            f"pass output_device={index} or None"
        )
    return rank_device


def _expected(device: torch.device) -> str:
    return f"[{device.index}]" if is_gpu(device) else "None"


def check_unsupported(**options: Any) -> None:
    """torch options that change what DDP computes, which threadpar's DDP does not implement."""
    unsupported = {
        "delay_all_reduce_named_params": None,
        "param_to_hook_all_reduce": None,
        "mixed_precision": None,
        "device_mesh": None,
        "skip_all_reduce_unused_params": False,
        "bucket_cap_mb_list": None,
    }
    given = [f"{k}={options[k]!r}" for k, default in unsupported.items() if options[k] is not default]
    if given:
        raise ConfigError(
            f"DistributedDataParallel: threadpar's DDP does not implement {', '.join(given)}; leave "
            "them out (for a device mesh pass process_group=, e.g. an axis name such as 'DP')"
        )
    if options["check_reduction"]:
        # torch ignores it and warns the same way (DistributedDataParallel.__init__).
        warnings.warn(
            "The `check_reduction` argument of DistributedDataParallel is deprecated in torch and has no effect",
            FutureWarning,
            stacklevel=3,
        )
    for name in ("static_graph", "batched_grad_copy", "init_sync", "check_reduction"):
        if not isinstance(options[name], bool):
            raise ConfigError(f"DistributedDataParallel: {name} must be True or False, got {options[name]!r}")


def move_inputs(device: torch.device, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Tensors anywhere in `inputs`/`kwargs` moved to `device` (torch DDP's forward with device_ids)."""
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    tree = torch.utils._pytree
    return tree.tree_map_only(torch.Tensor, move, inputs), tree.tree_map_only(torch.Tensor, move, kwargs)
