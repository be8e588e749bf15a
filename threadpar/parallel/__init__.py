"""Parallel wrappers and layers built on threadpar's process groups."""

from threadpar.parallel.data_parallel import DataParallel as DataParallel
from threadpar.parallel.ddp import DistributedDataParallel as DistributedDataParallel
