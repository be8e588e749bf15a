"""Which process of a multi-process job this is (torchrun's environment), and how the job bootstraps.

InfiniTrain counts ranks as nnodes x nproc_per_node x nthread_per_process; threadpar does the same: a
launcher such as torchrun starts the processes and sets torch.distributed's environment variables, and each
process runs `threads_per_process` rank threads. Global rank = process rank x threads_per_process + thread
rank. torch.distributed's default group (gloo on CPU, NCCL on GPU) and its store connect the processes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from threadpar.errors import ConfigError
from threadpar.runtime.rank_environ import process_environ

# torchrun (and `torch.distributed.launch`) set all of these; env:// initialisation needs them.
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job: `rank` of `count` processes, `local_rank` of `local_count` on its node.

    `store` is the torch.distributed Store the processes share; None means: take the default group's,
    initialising the default group first if the caller has not.
    """

    rank: int = 0
    count: int = 1
    local_rank: int = 0
    local_count: int = 1
    store: Any = None

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.count) or not (0 <= self.local_rank < self.local_count):
            raise ConfigError(
                f"inconsistent process environment: rank {self.rank} of {self.count}, "
                f"local rank {self.local_rank} of {self.local_count}"
            )


def _env_int(name: str, default: int | None = None) -> int:
    value = process_environ().get(name)  # the process's own, also in a rank thread (rank_environ)
    if value is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def local_place() -> tuple[int, int]:
    """This process's (LOCAL_RANK, LOCAL_WORLD_SIZE) from torchrun's variables; (0, 1) where they are unset or
    left over from another launcher."""
    local_count = _env_int("LOCAL_WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= local_rank < local_count:
        return 0, 1
    return local_rank, local_count


def process_env() -> ProcessEnv:
    """This process's place in the job: inside a rank thread, from its launch; else from an initialised
    torch.distributed default group, else from
    torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), else process 0 of 1."""
    import torch.distributed as dist

    from threadpar.runtime import context

    if context.in_rank():
        # A rank thread's torch.distributed world is the launch's ranks (the threadpar c10d backend), not
        # the processes: this process's place comes from the launch that started the thread.
        world = context.current().world
        rank, count = (0, 1) if world.processes is None else (world.processes.rank, world.processes.count)
        return ProcessEnv(rank, count, *local_place())
    if dist.is_available() and dist.is_initialized():
        return ProcessEnv(dist.get_rank(), dist.get_world_size(), *local_place())
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return ProcessEnv()
    count = _env_int("WORLD_SIZE")
    if count > 1:
        missing = [v for v in ENV_VARS if v not in os.environ]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={count} says this is one of {count} processes, but {', '.join(missing)} "
                "is not set; start the processes with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT in every process"
            )
    return ProcessEnv(_env_int("RANK"), count, _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1))


def default_local_devices(n_cuda: int, threads: int, local_rank: int, local_count: int) -> list[int]:
    """The CUDA device ids this process's rank threads use when the caller names none.

    Processes on one node that all see every GPU take consecutive blocks (process l: l*T .. l*T+T-1);
    a process that sees exactly T GPUs (CUDA_VISIBLE_DEVICES set per process) takes them all.
    """
    if n_cuda >= local_count * threads:
        return list(range(local_rank * threads, (local_rank + 1) * threads))
    if n_cuda == threads:
        return list(range(threads))
    raise ConfigError(
        f"{local_count} process(es) on this node with threads_per_process={threads} need "
        f"{local_count * threads} GPUs, but this process sees {n_cuda}; lower threads_per_process, start "
        "fewer processes per node, or pass devices=[...] (this process's GPU ids)"
    )


def bootstrap_store(env: ProcessEnv, on_gpu: bool, timeout: float) -> Any:
    """The store the processes share: env.store, or the default group's (initialised here if needed:
    gloo on CPU; on GPUs NCCL for CUDA tensors and gloo for CPU ones)."""
    if env.store is not None:
        return env.store
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if on_gpu else "gloo",
            timeout=datetime.timedelta(seconds=timeout),
        )
    return dist.distributed_c10d._get_default_store()
