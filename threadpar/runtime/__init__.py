"""Launching rank threads and the per-rank context."""

from threadpar.runtime.context import (
    RankContext,
    current,
    get_coords,
    get_device,
    get_generator,
    get_layout,
    get_process_rank,
    get_seed,
    get_thread_rank,
    in_rank,
    is_main_rank,
)
from threadpar.runtime.launch import launch
from threadpar.runtime.launch_config import DEFAULT_TIMEOUT_S, LaunchConfig
from threadpar.runtime.printing import print0, rank_print
from threadpar.runtime.process_env import ProcessEnv, process_env
from threadpar.runtime.torch_world import device_mesh

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LaunchConfig",
    "ProcessEnv",
    "RankContext",
    "current",
    "device_mesh",
    "get_coords",
    "get_device",
    "get_generator",
    "get_layout",
    "get_process_rank",
    "get_seed",
    "get_thread_rank",
    "in_rank",
    "is_main_rank",
    "launch",
    "print0",
    "process_env",
    "rank_print",
]
