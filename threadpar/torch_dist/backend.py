"""The `threadpar` c10d backend: registered with torch.distributed.Backend.register_backend.

c10d calls the creator in the thread that creates a group (the default group, `new_group`, a DeviceMesh's
dimensions); that thread is a rank thread of a launch, whose threadpar groups (rank_groups' thread-local)
give the group of the same global ranks: created once per launch and shared by all its members, whichever
API asked first.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm.rank_groups import current_groups
from threadpar.errors import ConfigError, NotInRankError
from threadpar.torch_dist.process_group import BACKEND_NAME, ThreadparProcessGroup

_register_lock = threading.Lock()


def _create(options: Any, backend_options: Any) -> ThreadparProcessGroup:
    """c10d's extended creator API: `options` is a _DistributedBackendOptions (group_rank, group_size,
    global_ranks_in_group: empty for the default group)."""
    try:
        groups = current_groups()
    except NotInRankError:
        raise ConfigError(
            f"torch.distributed's '{BACKEND_NAME}' backend serves the rank threads of threadpar.launch; "
            "create its groups inside the function you pass to threadpar.launch (where torch.distributed is "
            "already initialised), or use another backend here"
        ) from None
    ranks = list(options.global_ranks_in_group) or list(range(groups.source.world_size))
    handle = groups.handle(groups.source.groups.get_or_create(ranks))
    if handle.rank() != options.group_rank or handle.size() != options.group_size:
        raise ConfigError(
            f"torch.distributed asked for rank {options.group_rank} of {options.group_size} in group {ranks}, "
            f"but this thread is rank {handle.rank()} of {handle.size()} there"
        )
    return ThreadparProcessGroup(handle)


def register() -> None:
    """Register the backend with torch.distributed once per process (idempotent), for the host, CUDA and the
    process's PrivateUse1 accelerator if it has one (the CUDA double's simgpu: threadpar treats it as a GPU,
    comm/common/gpu.py), which may have been registered after the backend: it is added then."""
    accelerator = torch._C._get_privateuse1_backend_name()
    with _register_lock:
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        devices = dist.Backend.backend_capability[BACKEND_NAME]
        if accelerator != "privateuseone" and accelerator not in devices:
            dist.Backend.backend_capability[BACKEND_NAME] = [*devices, accelerator]
            dist.Backend.default_device_backend_map.setdefault(accelerator, BACKEND_NAME)
