"""The double's shared mode (issue 29): several rank threads on one fake GPU, over the `threads` backend.

`launch` places more ranks than GPUs round-robin on the `threads` backend (NCCL refuses two ranks of one
communicator on one GPU: src/init.cc, "Duplicate GPU detected"). `run_shared_fake_gpu` runs `fn` that way on
the CUDA double: rank thread r is on fake GPU r % gpus (fake_device_index.sharing_gpus), so the ranks of one GPU
share its stream pools (fake_cuda_nccl.FakeCuda.pool_stream) while each still computes on a default stream of
its own, the general case the backend's stream fences must order (comm/threads/stream_order.py). Tensors stay
on the CPU, as everywhere in the double.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from threadpar.errors import RankFailedError
from threadpar.runtime.launch import _Launch
from threadpar.runtime.world import World
from threadpar.topology import Layout

from .fake_cuda_nccl import FakeCuda
from .fake_device_index import sharing_gpus


def run_shared_fake_gpu(
    fn: Callable[[], Any],
    world_size: int,
    fake: FakeCuda | None = None,
    *,
    gpus: int = 1,
    timeout: float = 30.0,
    **layout: Any,
) -> list[Any]:
    """Run `fn` on `world_size` rank threads sharing `gpus` fake GPUs (1: all on fake GPU 0) of `fake` (a
    new FakeCuda when None), over the threads backend; re-raise a rank's own error."""
    world = World(
        layout=Layout.build(world_size, **layout),
        backend="threads",
        devices=(torch.device("cpu"),) * world_size,
        timeout=timeout,
        seed=0,
        intraop_threads=1,
        cuda=FakeCuda() if fake is None else fake,
    )
    try:
        with sharing_gpus(world, gpus):
            return _Launch(world, fn, (), {}).run()
    except RankFailedError as failed:
        failed.error.add_note(
            f"(raised on rank {failed.rank}, in the double's shared mode: {gpus} fake GPU(s))"
        )
        raise failed.error from None


def shared_runner(gpus: int = 1, **options: Any) -> Callable[[Callable[[], Any], int], list[Any]]:
    """A `runner(body, world)` for the reference helpers (tests/helpers: ddp_run, zero_run) in the shared mode."""
    return lambda body, world: run_shared_fake_gpu(body, world, gpus=gpus, **options)
