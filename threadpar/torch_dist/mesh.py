"""The launch's layout as a torch `DeviceMesh` whose dimensions are the layout's axes (names in lower case).

The mesh is torch's own, built in the rank thread; its dimension groups come from the `threadpar` backend,
which hands out the launch's groups of the same ranks, so `mesh["tp"]` runs on the same communicators as
threadpar's TP group (and `init_device_mesh` with the same shape gives the same groups).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from threadpar.errors import ConfigError
from threadpar.topology import Layout


def _fitting(layout: Layout) -> str:
    names = [a.value.lower() for a in layout.order]
    sizes = [layout.size(a) for a in layout.order]
    used = [(n, s) for n, s in zip(names, sizes, strict=True) if s > 1] or [(names[-1], sizes[-1])]
    return (
        f"mesh_shape={tuple(s for _, s in used)} with mesh_dim_names={tuple(n for n, _ in used)}, or all axes: "
        f"mesh_shape={tuple(sizes)} with mesh_dim_names={tuple(names)}"
    )


def layout_mesh(
    layout: Layout,
    device_type: str,
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A DeviceMesh over every rank of `layout`; by default its axes larger than 1, in layout order.

    `mesh_dim_names` picks axes (dp, tp, pp, cp; any order); `mesh_shape`, if given, must be their sizes."""
    order = [a.value.lower() for a in layout.order]
    size = {a.value.lower(): layout.size(a) for a in layout.order}
    if mesh_dim_names is None:
        names = [n for n in order if size[n] > 1] or [order[-1]]
    else:
        names = [str(n).lower() for n in mesh_dim_names]
    unknown = [n for n in names if n not in size]
    shape = tuple(size.get(n, 0) for n in names)
    covered = 1
    for n in set(names) - set(unknown):
        covered *= size[n]
    if (
        unknown
        or len(set(names)) != len(names)
        or covered != layout.world_size
        or (mesh_shape is not None and tuple(mesh_shape) != shape)
    ):
        asked = (
            f"mesh_shape={None if mesh_shape is None else tuple(mesh_shape)}, mesh_dim_names={tuple(names)}"
        )
        raise ConfigError(
            f"a device mesh with {asked} does not fit this launch's layout "
            f"({layout.describe()}, {layout.world_size} ranks); meshes that fit: {_fitting(layout)}"
        )
    # ranks[c_1, ..., c_k] for the chosen axes; the others are all 1 (covered == world_size).
    ranks = torch.arange(layout.world_size).reshape([size[n] for n in order])
    ranks = ranks.permute(
        [order.index(n) for n in names] + [i for i, n in enumerate(order) if n not in names]
    )
    ranks = ranks.reshape(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))
