"""What NCCL needs before threadpar's first communicator in a process, and unique ids shared across processes.

The environment (`prepare_environment`, once per process, before the first communicator):
- NCCL_RUNTIME_CONNECT=0. Since NCCL 2.22 (default 1) the first use of each collective algorithm connects the
  peers inside the group end, which then blocks the host until the peers do the same (src/enqueue.cc marks
  algoNeedConnect; src/transport.cc connects). threadpar's rank threads never wait for each other inside an
  operation, so every algorithm's connections are made when the communicator is created, where the members
  meet anyway. NCCL reads the variable once per process, at its first communicator, and caches it
  (src/include/param.h: NCCL_PARAM), so it is set before threadpar's first; a process in which another
  library made communicators earlier keeps what NCCL read then (the group's first operation still runs on a
  connector, connector.py, so a lazy connection there does not hang a rank). A value the user set is kept
  if it is 0; any other is refused.
- NCCL_COMM_BLOCKING must not be 0: it makes every communicator nonblocking (src/init.cc, envConfigOverride;
  since 2.17), whose operations then return ncclInProgress and are launched by a new thread each (connector.py
  says why threadpar's are blocking).
- Settings that make one process's rank threads wait for each other inside NCCL, refused (`REFUSED`), each
  read in NCCL's source: NCCL_LAUNCH_MODE=GROUP (src/group.cc, doLaunches: `ncclCommIntraBarrierIn` for the
  communicators of one clique in a process, a host barrier of the rank threads at every launch);
  NCCL_LAUNCH_ORDER_IMPLICIT=1 (src/enqueue.cc, getImplicitOrder and ncclLaunchPrepare: every launch on a
  device waits on `comm->context->launchOrder`, the previous NCCL launch on that device, and waits for it to
  finish where the driver predates CUDA 12.3 or a capture predates 12.9: a send, which runs until its receive
  does, then holds back every later operation of the device, and crossing point-to-point messages, a
  pipeline's, deadlock); NCCL_SINGLE_PROC_MEM_REG_ENABLE=1 (src/init.cc turns NVLS buffer registration off
  when two ranks share a process, this turns it back on; src/transport/nvls.cc registers a buffer with a host
  all-gather and barriers of the local ranks, ncclShmemAllgather / bootstrapIntraNodeBarrier, inside the
  launch, with no timeout).

Unique ids across processes: member 0 of a group creates the id and writes it to torch.distributed's store
(InfiniTrain writes it to a file; the store is already shared by every process of the job); the others wait
for it there, bounded by the launch's timeout and its stop signal.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from threadpar.comm.common.abort import AbortSignal
from threadpar.errors import CollectiveTimeoutError, ConfigError

RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"
COMM_BLOCKING = "NCCL_COMM_BLOCKING"
# variable -> (is a value refused, why, what to do): see the module docstring for the sources
REFUSED: dict[str, tuple[Callable[[str], bool], str, str]] = {
    "NCCL_LAUNCH_MODE": (
        lambda v: v.strip().upper() == "GROUP",
        "makes every NCCL launch a host barrier of the process's rank threads (src/group.cc, doLaunches)",
        "unset it or set it to PARALLEL (NCCL's default)",
    ),
    "NCCL_LAUNCH_ORDER_IMPLICIT": (
        lambda v: v.strip() not in ("", "0"),
        "orders every NCCL launch on a device after the previous one (src/enqueue.cc, ncclLaunchPrepare), up to "
        "its end on older drivers and in captures: a send waiting for its receive then holds back the device, "
        "and crossing point-to-point messages (pipelines, ring attention) deadlock; threadpar orders each "
        "device's calls itself (one thread per GPU, in program order)",
        "unset it or set it to 0",
    ),
    "NCCL_SINGLE_PROC_MEM_REG_ENABLE": (
        lambda v: v.strip() not in ("", "0"),
        "turns on NVLS buffer registration across ranks of one process, which registers with a host all-gather "
        "and barriers of the local ranks inside the launch, without a timeout (src/transport/nvls.cc); one "
        "rank thread then waits for the others, which a graph capture's turns never let come",
        "unset it or set it to 0",
    ),
}
_environment_lock = threading.Lock()
POLL = datetime.timedelta(milliseconds=100)  # how often a store wait looks at the stop signal


def prepare_environment() -> None:
    """Set NCCL's environment for threadpar's communicators (see the module docstring); idempotent."""
    with _environment_lock:
        for name, (refused, why, fix) in REFUSED.items():
            value = os.environ.get(name)
            if value is not None and refused(value):
                raise ConfigError(f"{name}={value!r} {why}: {fix}")
        blocking = os.environ.get(COMM_BLOCKING)
        if blocking is not None and blocking.strip() == "0":
            raise ConfigError(
                f"{COMM_BLOCKING}=0 makes every NCCL communicator nonblocking: each operation would return "
                "ncclInProgress and be launched by a thread of its own; threadpar's communicators are blocking "
                f"(it bounds their creation itself): unset {COMM_BLOCKING} or set it to 1"
            )
        value = os.environ.get(RUNTIME_CONNECT)
        if value is None:
            os.environ[RUNTIME_CONNECT] = "0"
        elif value.strip() != "0":
            raise ConfigError(
                f"{RUNTIME_CONNECT}={value!r}: threadpar needs NCCL to connect peers when communicators are "
                "created (a first collective that connects lazily blocks the host until the peers come, inside "
                f"an operation no rank should wait in); unset {RUNTIME_CONNECT} or set it to 0"
            )


def unique_id_key(group_key: str) -> str:
    return f"nccl/{group_key}/unique_id"


def shared_unique_id(
    store: Any,
    key: str,
    creator: bool,
    make: Callable[[], bytes],
    abort: AbortSignal,
    timeout: float,
    describe_timeout: Callable[[], str],
) -> bytes:
    """The bytes under `key` in the launch's store: `make()` and written there by the `creator`, read by
    everyone else once it is (a wait bounded by `timeout`, ended by a stop)."""
    if creator:
        store.set(key, make())
    else:
        deadline = time.monotonic() + timeout
        while True:
            try:
                store.wait([key], POLL)
                break
            except RuntimeError:  # DistStoreError: not there yet
                abort.raise_if_set()
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(describe_timeout()) from None
    return store.get(key)
