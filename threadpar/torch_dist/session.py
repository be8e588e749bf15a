"""torch.distributed inside one rank thread: initialised when the rank starts, torn down when it ends.

`TorchDistSession.start()` gives the thread its own torch.distributed world (world.py) whose default group
is the launch's world on the `threadpar` backend, made the way `init_process_group` makes it (c10d's own
`_new_process_group_helper`), without `init_process_group`'s process-wide side effects (its excepthook, its
module globals). A tutorial's own `dist.init_process_group(...)` in the rank is then checked against the
thread's rank and world size and accepted (`init_process_group`); `destroy_process_group()` is torch's own,
acting on the thread's world.

Autograd runs a rank's backward on the rank thread (`set_multithreading_enabled(False)`, thread-local):
torch's hooks (FSDP2's, DDP's) look up torch.distributed state of the rank, which a device thread of
autograd would not see (DESIGN.md rule 2, for code we do not own).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from threadpar.errors import ConfigError
from threadpar.torch_dist import world as rank_world
from threadpar.torch_dist.backend import register
from threadpar.torch_dist.process_group import BACKEND_NAME

_local = threading.local()


class TorchDistSession:
    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._timeout = timedelta(seconds=timeout)
        self._world = rank_world.RankWorld()
        self._multithreading: bool | None = None
        self.noted = False  # the one-line note about a mapped init_process_group was printed

    def start(self) -> None:
        register()
        _local.session = self
        rank_world.bind(self._world)
        self._multithreading = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        self.init_default_group()

    def init_default_group(self) -> None:
        """What init_process_group(backend="threadpar", store=...) does to this thread's world."""
        name = c10d._process_group_name([], use_hashed_name=False)
        pg, _ = c10d._new_process_group_helper(
            self.world_size,
            self.rank,
            [],
            dist.Backend(BACKEND_NAME),
            dist.PrefixStore("default_pg", self._store),
            name,
            timeout=self._timeout,
            group_desc="default_pg",
        )
        c10d._update_default_pg(pg)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}

    def end(self) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            rank_world.bind(None)
            _local.session = None
            if self._multithreading is not None:
                torch._C._set_multithreading_enabled(self._multithreading)

    def end_quietly(self) -> None:
        """`end()` after the rank failed: tear down what can be, without raising."""
        try:
            self.end()
        except Exception:
            rank_world.bind(None)
            _local.session = None


def current_session() -> TorchDistSession | None:
    return getattr(_local, "session", None)


def init_process_group(
    backend: Any = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    **more: Any,
) -> None:
    """Replaces torch.distributed.init_process_group while a launch runs: in a rank thread, accept the
    call when its rank and world size (if given) are the thread's; elsewhere, torch's own."""
    session = current_session()
    if session is None:
        return _ORIGINAL["init_process_group"](
            backend=backend,
            init_method=init_method,
            timeout=timeout,
            world_size=world_size,
            rank=rank,
            store=store,
            group_name=group_name,
            pg_options=pg_options,
            device_id=device_id,
            **more,
        )
    if (rank not in (-1, None) and rank != session.rank) or (
        world_size not in (-1, None) and world_size != session.world_size
    ):
        raise ConfigError(
            f"init_process_group(rank={rank}, world_size={world_size}) in the thread of threadpar rank "
            f"{session.rank} of {session.world_size}: inside threadpar.launch, torch.distributed is already "
            f"initialised as rank {session.rank} of world size {session.world_size}; pass those (or leave "
            "rank and world_size out)"
        )
    if not dist.is_initialized():
        session.init_default_group()  # the rank destroyed its group earlier
    if not session.noted and session.rank == 0:
        session.noted = True
        asked = "the default backend" if backend is None else f"backend {str(backend)!r}"
        print(
            f"threadpar: init_process_group({asked}) runs on the '{BACKEND_NAME}' backend of this launch's "
            f"rank threads ({session.world_size} ranks)",
            flush=True,
        )


_ORIGINAL: dict[str, Any] = {"init_process_group": dist.init_process_group}

# What world.Routing replaces while a launch runs.
PATCHES = {"init_process_group": init_process_group}
