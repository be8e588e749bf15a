"""Which backend object a new group gets: the launch's backend, or a spanning one for groups across processes."""

from __future__ import annotations

from typing import Any

from threadpar.comm.backend import Backend, BackendSite
from threadpar.comm.common.gpu import is_gpu
from threadpar.errors import ConfigError


class _TimedSite:
    """The launch's BackendSite with a group's own timeout (new_group(timeout=...))."""

    def __init__(self, site: BackendSite, timeout: float) -> None:
        self._site = site
        self.timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._site, name)


def select_backend(
    site: BackendSite, name: str, ranks: tuple[int, ...], timeout: float | None = None
) -> Backend:
    """The backend for the group `name` of global `ranks` (the registry calls this once per group);
    `timeout`: the group's own, instead of the launch's.

    The backends are imported on first use: a CPU launch never loads the nccl package, a one-process launch
    never loads gloo.
    """
    if timeout is not None:
        site = _TimedSite(site, timeout)
    here = len(ranks) if site.processes is None else sum(r in site.local_ranks for r in ranks)
    if 0 < here < len(ranks):
        return _spanning_backend(site, name, ranks, timeout)
    if site.backend == "threads" or here == 0:  # (no member here: a stand-in that is never used)
        from threadpar.comm.threads.group import ThreadsGroup

        order = None
        if site.cuda is not None or any(is_gpu(site.devices[r]) for r in ranks):
            from threadpar.comm.threads.stream_order import StreamOrder

            order = StreamOrder(site.cuda_api(), [site.devices[r] for r in ranks])
        return ThreadsGroup(name, ranks, site.abort, site.timeout, order)
    if site.backend == "nccl":
        from threadpar.comm.nccl.group import NcclGroup

        return NcclGroup(name, ranks, site)
    raise ConfigError(f"unknown backend {site.backend!r}")


def _spanning_backend(site: BackendSite, name: str, ranks: tuple[int, ...], timeout: float | None) -> Backend:
    """A group with members in this process and in others; its key (the same in every process) tells it
    from another group of the same ranks with a timeout of its own."""
    from threadpar.comm.hierarchical.group import HierarchicalGroup, group_key

    key = group_key(ranks, timeout)
    if site.backend == "nccl":
        from threadpar.comm.nccl.spanning import NcclSpanningGroup

        return NcclSpanningGroup(name, ranks, site, key)
    return HierarchicalGroup(name, ranks, site.processes, site.abort, site.timeout, key=key)
