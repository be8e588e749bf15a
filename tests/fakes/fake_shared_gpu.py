"""The double's shared mode (issue 29): several rank threads on one fake GPU, over the `threads` backend.

`launch` places more ranks than GPUs round-robin on the `threads` backend (NCCL refuses two ranks of one
communicator on one GPU: src/init.cc, "Duplicate GPU detected"). `run_shared_fake_gpu` runs `fn` that way on
the CUDA double: rank thread r is on fake GPU r % gpus (its device simgpu:(r % gpus), as launch places them), so
the ranks of one GPU share its stream pools (fake_cuda_nccl.FakeCuda.pool_stream) while each still computes on a
default stream of its own, the general case the backend's stream fences must order
(comm/threads/stream_order.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from threadpar.errors import RankFailedError
from threadpar.runtime.launch import _Launch
from threadpar.runtime.world import World
from threadpar.topology import Layout

from . import sim_gpu
from .fake_cuda_nccl import FakeCuda, on_device


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
    if gpus < 1:
        raise ValueError(f"gpus={gpus}: the ranks need at least one fake GPU to share")
    fake = FakeCuda() if fake is None else fake
    world = World(
        layout=Layout.build(world_size, **layout),
        backend="threads",
        devices=tuple(sim_gpu.device(r % gpus) for r in range(world_size)),
        timeout=timeout,
        seed=0,
        intraop_threads=1,
        cuda=fake,
    )
    try:
        return _Launch(world, on_device(fake, fn, touch=False), (), {}).run()
    except RankFailedError as failed:
        failed.error.add_note(
            f"(raised on rank {failed.rank}, in the double's shared mode: {gpus} fake GPU(s))"
        )
        raise failed.error from None


def shared_runner(gpus: int = 1, **options: Any) -> Callable[[Callable[[], Any], int], list[Any]]:
    """A `runner(body, world)` for the reference helpers (tests/helpers: ddp_run, zero_run) in the shared mode."""
    return lambda body, world: run_shared_fake_gpu(body, world, gpus=gpus, **options)
