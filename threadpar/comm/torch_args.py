"""torch.distributed's arguments, read the way torch reads them and checked against the calling rank.

The module-level namesakes (functional.py, objects.py, batch.py, membership.py) take torch.distributed's
parameters; what those mean for a rank thread is decided here once: a global or a group rank for a peer
(`group_src=`/`group_dst=`), a timeout as a `timedelta` or seconds, `device_ids`/`device_id` that must name
the rank's own device, and a backend name that must be the launch's.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch

from threadpar.comm.common.gpu import device_of_index, is_gpu
from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError

# torch.distributed's backend names, and what stands for them in a launch (runtime/devices.BACKENDS).
TORCH_BACKENDS = {"gloo": "threads", "nccl": "nccl"}


def peer(
    op: str, group: ProcessGroup, what: str, global_rank: int | None, group_rank: int | None
) -> int | None:
    """The global rank of a peer given as `src`/`dst` (a global rank) or `group_src`/`group_dst` (its rank in
    `group`), as torch's _canonicalize_group_rank takes them: one or the other, not both. None if neither."""
    if group_rank is None:
        return global_rank
    if global_rank is not None:
        raise ConfigError(
            f"{op}: pass {what}={global_rank} (a global rank) or group_{what}={group_rank} (a rank in the "
            "group), not both"
        )
    return global_of(op, group, group_rank)


def required_peer(
    op: str, group: ProcessGroup, what: str, global_rank: int | None, group_rank: int | None
) -> int:
    rank = peer(op, group, what, global_rank, group_rank)
    if rank is None:
        raise ConfigError(f"{op}: pass {what}= (a global rank) or group_{what}= (a rank in the group)")
    return rank


def global_of(op: str, group: ProcessGroup, group_rank: int) -> int:
    """The global rank of member `group_rank` of `group` (torch.distributed.get_global_rank)."""
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < group.size():
        raise ConfigError(
            f"{op}: group rank {group_rank!r} is not in group '{group.name}' (its ranks are 0..{group.size() - 1}, "
            f"global ranks {list(group.ranks)})"
        )
    return group.ranks[group_rank]


def seconds(op: str, timeout: object) -> float | None:
    """A timeout given as torch takes it (a datetime.timedelta; a number of seconds is accepted too)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise ConfigError(f"{op}: timeout must be a datetime.timedelta (or seconds), got {timeout!r}")
    if value <= 0:
        raise ConfigError(f"{op}: timeout must be positive, got {timeout!r}")
    return value


def _as_device(value: object, device: torch.device) -> torch.device:
    if isinstance(value, int) and not isinstance(value, bool):
        return device_of_index(value, device)  # torch: a bare index names a CUDA device
    return torch.device(value)  # type: ignore[call-overload]


def check_device_ids(op: str, device_ids: object, device: torch.device) -> None:
    """torch takes one CUDA device index (or device) in a list; here it must be this rank's device. On a CPU
    rank torch's gloo ignores device_ids (barrier), so any list is accepted there."""
    if device_ids is None:
        return
    if not isinstance(device_ids, Sequence) or isinstance(device_ids, str) or len(device_ids) != 1:
        raise ConfigError(f"{op}: device_ids must be a list of one device, got {device_ids!r}{_pass(device)}")
    if device.type == "cpu":
        return
    try:
        given = _as_device(device_ids[0], device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{op}: device_ids={device_ids!r} names no device{_pass(device)}") from None
    if given != device:
        raise ConfigError(
            f"{op}: device_ids={device_ids!r} is not this rank's device {device}{_pass(device)}"
        )


def check_device_id(op: str, device_id: object, device: torch.device) -> None:
    """`device_id` (init_process_group, new_group): a device, or a CUDA index; it must be this rank's."""
    if device_id is None:
        return
    try:
        given = _as_device(device_id, device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"{op}: device_id={device_id!r} names no device; pass {_device_arg(device)}"
        ) from None
    same = given == device or (given.type == device.type and given.index is None and device.type == "cpu")
    if not same:
        raise ConfigError(
            f"{op}: device_id={device_id!r} is not this rank's device {device}; pass {_device_arg(device)} "
            "(threadpar.get_device()) or None"
        )


def check_backend(op: str, backend: object, launch_backend: str, device: torch.device) -> None:
    """A backend name is accepted when it is the launch's, or torch's name for it ("gloo" for `threads`,
    "nccl"); a per-device spec ("cpu:gloo,cuda:nccl") when its entry for this rank's device type is."""
    if backend is None:
        return
    name = str(backend).lower()
    if ":" in name:
        entries = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = entries.get(device.type, "")
    if name == launch_backend or TORCH_BACKENDS.get(name) == launch_backend:
        return
    torch_name = {v: k for k, v in TORCH_BACKENDS.items()}.get(launch_backend, launch_backend)
    raise ConfigError(
        f"{op}: backend={backend!r} is not this launch's backend '{launch_backend}' (torch's '{torch_name}'); "
        "every threadpar group uses the launch's backend: pass backend=None"
    )


def _device_arg(device: torch.device) -> str:
    return f"device_id={device.index}" if is_gpu(device) else "device_id=None"


def _pass(device: torch.device) -> str:
    return f"; pass device_ids=[{device.index}] (this rank's device) or None" if is_gpu(device) else ""
