"""Process groups and collectives (torch.distributed's API); the backends are the sub-packages `threads`, `nccl`
and `hierarchical`, on the machinery they share in `common`."""

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.comm.functional import (
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
from threadpar.comm.group import ProcessGroup

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "get_group",
    "get_rank",
    "get_world_size",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
