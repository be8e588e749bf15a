"""Who is in which group, and the default group's lifetime: torch.distributed's queries for a rank thread.

A rank thread is initialised by `threadpar.launch` itself: `is_initialized()` is True inside one, and
`init_process_group(...)` (tutorial code) only checks that what it asks for is what the thread is. The
launch frees its groups when it ends, so `destroy_process_group()` has nothing to free. (threadpar's
integration with torch.distributed itself, a c10d backend, maps torch's own functions: see issue 19.)
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from threadpar.comm import torch_args
from threadpar.comm.functional import GroupLike, get_group
from threadpar.comm.rank_groups import current_groups, has_groups
from threadpar.comm.torch_signatures import follows
from threadpar.errors import ConfigError


def is_available() -> bool:
    """Whether threadpar can run here, as torch.distributed.is_available() says for torch (a script written
    for dist calls it first): always True, since rank threads run on CPU threads when there is no GPU (and the
    backend choice, nccl or threads, is the launch's: threadpar.runtime.devices.resolve_placement)."""
    return True


def is_initialized() -> bool:
    """True in a rank thread of `threadpar.launch` (its world group exists), False elsewhere."""
    return has_groups()


def get_backend(group: GroupLike = None) -> str:
    """The backend of `group` (the world when None): "threads", "nccl" or "hierarchical" (between processes)."""
    return get_group(group)._backend.backend_name


def get_process_group_ranks(group: GroupLike) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    return list(get_group(group).ranks)


def get_global_rank(group: GroupLike, group_rank: int) -> int:
    """The global rank of member `group_rank` of `group`."""
    return torch_args.global_of("get_global_rank", get_group(group), group_rank)


def get_group_rank(group: GroupLike, global_rank: int) -> int:
    """The rank in `group` of global rank `global_rank` (a ConfigError if it is not a member)."""
    return get_group(group).group_rank(global_rank)


@follows(dist.init_process_group)
def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: torch.device | int | None = None,
    _ranks: list[int] | None = None,
    enable_reconfigure: bool = False,
) -> None:
    """In a rank thread: check that the call describes this thread; the launch has already initialised it.

    `rank`/`world_size` (when given) must be the thread's, `backend` the launch's (or torch's name for it),
    `device_id` the rank's device, `timeout` the launch's. `init_method` and `store` say how processes
    meet, which the launch has done: they are accepted and not used. `enable_reconfigure` (torch 2.14:
    communicators made later, by ProcessGroup.reconfigure) must stay False: threadpar's groups are connected
    when made and have no reconfigure.
    """
    groups = current_groups()
    source = groups.source
    mine = f"this rank thread is rank {groups.rank} of world_size {source.world_size}"
    if rank != -1 and rank != groups.rank:
        raise ConfigError(
            f"init_process_group: rank={rank} but {mine}; pass rank=threadpar.get_rank() or leave it out"
        )
    if world_size != -1 and world_size != source.world_size:
        raise ConfigError(
            f"init_process_group: world_size={world_size} but {mine}; pass "
            "world_size=threadpar.get_world_size() or leave it out"
        )
    if _ranks is not None and list(_ranks) != list(range(source.world_size)):
        raise ConfigError(f"init_process_group: _ranks={_ranks!r} but {mine}")
    torch_args.check_backend("init_process_group", backend, source.backend, groups.device)
    torch_args.check_device_id("init_process_group", device_id, groups.device)
    seconds = torch_args.seconds("init_process_group", timeout)
    if seconds is not None and seconds != source.timeout:
        raise ConfigError(
            f"init_process_group: timeout={timeout!r} but the launch's timeout is {source.timeout:g} s; "
            f"pass timeout= to threadpar.launch (or leave it out here)"
        )
    if pg_options is not None:
        raise ConfigError("init_process_group: threadpar's groups take no pg_options; pass pg_options=None")
    if enable_reconfigure:
        raise ConfigError(
            "init_process_group: enable_reconfigure=True asks for groups connected later by "
            "ProcessGroup.reconfigure, which threadpar's groups (connected when made) do not have; pass False"
        )
    del init_method, store, group_name  # how processes meet: the launch has already met its ranks


def destroy_process_group(group: GroupLike = None) -> None:
    """Accepted in a rank thread (checks `group` exists); the launch frees every group when it ends."""
    get_group(group)
