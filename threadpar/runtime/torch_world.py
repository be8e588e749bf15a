"""torch.distributed in the rank threads of a launch (threadpar.torch_dist), and the layout as a DeviceMesh.

`LaunchConfig(torch_distributed=True)` (the default): while the launch runs, torch.distributed is routed
per thread; each rank thread starts with its own world whose default group is the launch's world on the
`threadpar` backend, and tears it down when it ends. The caller's torch.distributed is as it was after.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from threadpar.runtime.context import current

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from threadpar.runtime.world import World
    from threadpar.torch_dist.session import TorchDistSession


class LaunchTorchWorld:
    """One launch's part: install the routing for its duration, a session per rank thread."""

    def __init__(self, world: World) -> None:
        import torch.distributed as dist

        self._world = world
        self._store = dist.HashStore()  # shared by the launch's rank threads (c10d's groups take a store)
        self._lock = threading.Lock()  # guards _installed
        self._installed = False

    def install(self) -> None:
        from threadpar.torch_dist.session import PATCHES
        from threadpar.torch_dist.world import ROUTING

        with self._lock:
            ROUTING.install(PATCHES)
            self._installed = True

    def uninstall(self) -> None:
        from threadpar.torch_dist.world import ROUTING

        with self._lock:
            if self._installed:
                self._installed = False
                ROUTING.uninstall()

    def session(self, rank: int) -> TorchDistSession:
        from threadpar.torch_dist.session import TorchDistSession

        return TorchDistSession(rank, self._world.world_size, self._store, self._world.timeout)


def device_mesh(
    mesh_shape: Sequence[int] | None = None, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """The launch's layout as a torch DeviceMesh (inside a rank, with torch_distributed on): by default the
    axes larger than 1, named "pp", "dp", "cp", "tp" in layout order; `mesh_dim_names` picks axes (and
    `mesh_shape` must then be their sizes). Its groups are the launch's groups of the same ranks."""
    import torch.distributed as dist

    from threadpar.torch_dist.mesh import layout_mesh

    ctx = current()
    if not ctx.world.torch_distributed or not dist.is_initialized():
        raise RuntimeError(
            "threadpar.device_mesh needs torch.distributed in the rank threads: launch with "
            "torch_distributed=True (the default), and do not call destroy_process_group before"
        )
    device_type = ctx.device.type
    return layout_mesh(ctx.world.layout, device_type, mesh_shape, mesh_dim_names)
