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
_environment_lock = threading.Lock()
POLL = datetime.timedelta(milliseconds=100)  # how often a store wait looks at the stop signal


def prepare_environment() -> None:
    """Set NCCL's environment for threadpar's communicators (see the module docstring); idempotent."""
    with _environment_lock:
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
