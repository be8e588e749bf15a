"""NCCL communicators for a group whose member threads live in several processes.

In one process every member thread joins at once (ncclCommInitRank from each, concurrently). Across processes every
member joins with ncclCommInitRank and the group's unique id, which must reach every process: member 0
creates it and writes it to torch.distributed's store (InfiniTrain writes it to a file; the store is
already shared by every process of the job), the others wait for it there.

ncclCommInitRank blocks until all members have joined, so each member thread calls `join_nccl_group` for
itself, on its own device (after torch.cuda.set_device), at the same time as the others: the rank threads
of a launch do exactly that when they first use the group. The nccl backend keeps one communicator per
member and launches grouped calls for the local members as it does within one process. Peers are
connected at creation (`connect_eagerly`), so that no grouped call ever waits for another process.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any

from threadpar.comm.common.cuda_seam import NcclApi
from threadpar.errors import CollectiveTimeoutError, ConfigError

RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"
_environment_lock = threading.Lock()


def connect_eagerly() -> None:
    """Make NCCL connect a communicator's peers when it is created, not on first use (NCCL_RUNTIME_CONNECT=0).

    Since NCCL 2.22 (NCCL_RUNTIME_CONNECT=1 by default) the first collective of each algorithm connects the
    peers inside ncclGroupEnd, blocking until the other processes do the same. threadpar issues every
    grouped call under its process's launch lock, so two processes that launch the first collectives of two
    groups in opposite orders would each hold their lock while waiting for the other: a deadlock. Connected
    at creation (where each member thread blocks for itself, no lock held), a grouped call never waits for
    another process. The cost: every algorithm's connections and buffers are set up at creation.

    NCCL reads the variable once per process, at its first communicator (src/init.cc, comm->runtimeConn), so
    this runs when a launch that spans processes is set up, before any communicator exists. A value the user
    set is kept if it is 0; any other is refused (it can deadlock, see above)."""
    with _environment_lock:
        value = os.environ.get(RUNTIME_CONNECT)
        if value is None:
            os.environ[RUNTIME_CONNECT] = "0"
        elif value.strip() != "0":
            raise ConfigError(
                f"{RUNTIME_CONNECT}={value!r}: with NCCL groups that span processes threadpar needs NCCL to connect "
                f"peers when communicators are created (a first collective that connects lazily can deadlock two "
                f"processes' launches); unset {RUNTIME_CONNECT} or set it to 0"
            )


def unique_id_key(group_key: str) -> str:
    return f"nccl/{group_key}/unique_id"


def join_nccl_group(
    store: Any, group_key: str, member: int, size: int, timeout: float, nccl: NcclApi, device: int
) -> Any:
    """This member's communicator of the group `group_key` (the same string in every process, e.g. the
    hex of threadpar.comm.hierarchical.group.group_key(ranks)) with `size` members, on CUDA device `device`;
    `store` is a client of the launch's store (Processes.store_client()), `nccl` NCCL's C API."""
    key = unique_id_key(group_key)
    if member == 0:
        store.set(key, nccl.get_unique_id())
    else:
        try:
            store.wait([key], datetime.timedelta(seconds=timeout))
        except RuntimeError:
            raise CollectiveTimeoutError(
                f"member {member} of NCCL group {group_key} waited {timeout:g} s for member 0 to publish the "
                "group's unique id; member 0's process did not create the group (does it call the same "
                "collectives?)"
            ) from None
    return nccl.comm_init_rank(size, store.get(key), member, device)
