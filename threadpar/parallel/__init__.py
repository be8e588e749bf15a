"""Parallel wrappers built on threadpar's process groups: `from threadpar.parallel import ...`."""

from threadpar.parallel import tensor_parallel
from threadpar.parallel.data_parallel import DataParallel
from threadpar.parallel.ddp import DistributedDataParallel
from threadpar.parallel.tensor_parallel import *  # noqa: F403  (tensor and sequence parallelism)

__all__ = ["DataParallel", "DistributedDataParallel", *tensor_parallel.__all__]
