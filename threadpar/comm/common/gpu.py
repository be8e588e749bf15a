"""Which devices are GPUs to threadpar: CUDA's, or an accelerator torch knows through its PrivateUse1 key.

Code that branches on "is this rank on a GPU" (its work stream-ordered, its memory apart from the host's, a
current device to set) asks `is_gpu`, so that a device registered as PrivateUse1 takes the branch a GPU takes:
the CUDA double's `simgpu` (tests/fakes/sim_gpu.py) is one, which is how the tests run the code a GPU runs.
threadpar drives such a device only through a `CudaApi` given to its World (`World(cuda=...)`); on its own it
speaks CUDA.
"""

from __future__ import annotations

import torch


def is_gpu(device: torch.device) -> bool:
    return device.type == "cuda" or device.type == torch._C._get_privateuse1_backend_name()


def set_current_device(device: torch.device) -> None:
    """Make `device` the calling thread's current device (torch.cuda.set_device, or the PrivateUse1 backend's
    module: torch.get_device_module)."""
    torch.get_device_module(device).set_device(device)


def device_of_index(index: int, like: torch.device) -> torch.device:
    """What a bare device index names where torch takes one (device_ids=[i], device_id=i): a device of the
    rank's own GPU type (torch: a CUDA index on CUDA)."""
    return torch.device(like.type if is_gpu(like) else "cuda", index)
