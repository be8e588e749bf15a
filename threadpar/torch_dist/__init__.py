"""torch.distributed on threadpar's rank threads: the `threadpar` c10d backend, a torch.distributed world per
rank thread, and the launch's layout as a DeviceMesh (see notes/issue-19-c10d.md)."""

from threadpar.torch_dist.process_group import BACKEND_NAME, ThreadparProcessGroup

__all__ = ["BACKEND_NAME", "ThreadparProcessGroup"]
