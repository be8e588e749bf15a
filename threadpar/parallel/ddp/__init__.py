"""DistributedDataParallel: the wrapper, its Reducer, the pure bucket assignment and the comm hooks."""

from threadpar.parallel.ddp import comm_hooks
from threadpar.parallel.ddp.comm_hooks import GradBucket
from threadpar.parallel.ddp.distributed import DistributedDataParallel
from threadpar.parallel.ddp.reducer import Reducer, ReducerOptions

__all__ = ["DistributedDataParallel", "GradBucket", "Reducer", "ReducerOptions", "comm_hooks"]
