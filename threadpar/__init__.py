"""threadpar: train PyTorch models on every GPU of a node from one process, one thread per device.

import threadpar

def train():
    rank, device = threadpar.get_rank(), threadpar.get_device()
    ...
    threadpar.all_reduce(tensor, group="DP")

threadpar.launch(train, world_size=8, tp=2, pp=2)   # dp = 8 / (2 * 2) = 2
"""

from threadpar import errors
from threadpar.comm import (
    ProcessGroup,
    ReduceOp,
    Work,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    get_group,
    get_rank,
    get_world_size,
    irecv,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from threadpar.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    RankAborted,
    RankFailedError,
    RemoteRankError,
    ThreadparError,
)
from threadpar.runtime import (
    LaunchConfig,
    device_mesh,
    get_coords,
    get_device,
    get_generator,
    get_layout,
    get_process_rank,
    get_seed,
    get_thread_rank,
    in_rank,
    is_main_rank,
    launch,
    print0,
    process_env,
    rank_print,
)
from threadpar.topology import Axis, Coords, Layout

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "Coords",
    "LaunchConfig",
    "Layout",
    "ProcessGroup",
    "RankAborted",
    "RankFailedError",
    "ReduceOp",
    "RemoteRankError",
    "ThreadparError",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "device_mesh",
    "errors",
    "gather",
    "get_coords",
    "get_device",
    "get_generator",
    "get_group",
    "get_layout",
    "get_process_rank",
    "get_rank",
    "get_seed",
    "get_thread_rank",
    "get_world_size",
    "in_rank",
    "irecv",
    "is_main_rank",
    "isend",
    "launch",
    "new_group",
    "print0",
    "process_env",
    "rank_print",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
