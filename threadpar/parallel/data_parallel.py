"""DataParallel: one controlling thread splits each batch over devices and runs the replicas on threads.

    model = DataParallel(MyModel().cuda(), device_ids=[0, 1])   # or device_ids=["cpu"] * 4 without GPUs
    loss_fn(model(x), y).backward()                            # gradients land in MyModel's parameters

As torch.nn.DataParallel (and InfiniTrain's DataParallel): every forward scatters the inputs along `dim`,
replicates the module onto the devices so that gradients flow back to the source parameters, runs the
replicas on threads (each on its device, with the caller's grad mode and autocast) and gathers the outputs
on `output_device`. Replica 0 is the module itself; the others copy its buffers, so in-forward buffer
updates (BatchNorm running stats) are kept from replica 0 only. No launch() or process group is needed.

On CPU virtual devices the replicas share the parameters and split the cores; the backward pass then runs
on the calling thread, as PyTorch's CPU autograd does, so only the forward runs in parallel there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from threadpar.errors import ConfigError
from threadpar.parallel.scatter_gather import gather, scatter_kwargs
from threadpar.runtime.intraop import set_thread_intraop_threads

DeviceIds = int | Sequence[int | str | torch.device] | None


def resolve_devices(device_ids: DeviceIds) -> list[torch.device]:
    """None: every visible GPU (the CPU without GPUs); an int n: n GPUs, or n CPU virtual devices without
    GPUs; a list: CUDA ids or devices ("cpu" may repeat, one replica per entry)."""
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_ids is None:
        return [torch.device("cuda", i) for i in range(n_cuda)] or [torch.device("cpu")]
    if (
        isinstance(device_ids, bool)
        or not isinstance(device_ids, (int, Sequence))
        or isinstance(device_ids, str)
    ):
        raise ConfigError(f"device_ids must be None, an int, or a list of devices; got {device_ids!r}")
    if isinstance(device_ids, int):
        if device_ids < 1:
            raise ConfigError(f"device_ids={device_ids}: ask for at least one device")
        if n_cuda == 0:
            return [torch.device("cpu")] * device_ids
        device_ids = list(range(device_ids))
    devices = []
    for d in device_ids:
        if isinstance(d, int) and not isinstance(d, bool):
            d = torch.device("cuda", d)
        elif isinstance(d, (str, torch.device)):
            d = torch.device(d)
        else:
            raise ConfigError(f"device_ids entries must be CUDA ids, 'cpu' or torch.device; got {d!r}")
        if d.type == "cuda":
            index = 0 if d.index is None else d.index
            if index >= n_cuda:
                raise ConfigError(
                    f"DataParallel: {d} is not available ({n_cuda} GPUs visible); use device_ids=['cpu'] * n "
                    "for CPU virtual devices"
                )
            d = torch.device("cuda", index)
        devices.append(d)
    if not devices:
        raise ConfigError("device_ids is empty; give at least one device")
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        raise ConfigError(f"device_ids lists a GPU twice: {[str(d) for d in devices]}")
    return devices


def _copy_buffer(buffer: torch.Tensor, device: torch.device, same_device: bool) -> torch.Tensor:
    if buffer.requires_grad:
        return buffer if same_device else buffer.to(device)
    return buffer.detach().to(device, copy=True)


def replicate(module: nn.Module, device: torch.device, source: torch.device) -> nn.Module:
    """A shallow copy of the module tree for `device`: on the source device it shares the parameters, on
    another it holds differentiable copies of them (as plain attributes, so replicas have no leaves).
    Buffers are copies; modules and parameters shared within the tree stay shared in the replica."""
    same_device = device == source
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}

    def tensor_copy(t: torch.Tensor, make) -> torch.Tensor:
        if id(t) not in tensors:
            tensors[id(t)] = make(t)
        return tensors[id(t)]

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in modules:
            return modules[id(m)]
        replica = m.__new__(type(m))
        replica.__dict__ = m.__dict__.copy()
        modules[id(m)] = replica
        replica._modules = type(m._modules)(
            (k, None if c is None else copy(c)) for k, c in m._modules.items()
        )
        replica._buffers = type(m._buffers)(
            (k, None if b is None else tensor_copy(b, lambda t: _copy_buffer(t, device, same_device)))
            for k, b in m._buffers.items()
        )
        if not same_device:
            replica._parameters = type(m._parameters)()
            for k, p in m._parameters.items():
                if p is None:
                    replica._parameters[k] = None
                else:  # a non-leaf tensor: set as a plain attribute, as torch's replicate does
                    replica.__dict__[k] = tensor_copy(p, lambda t: t.to(device))
        return replica

    return copy(module)


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[tuple],
    kwargs: Sequence[dict],
    devices: Sequence[torch.device],
) -> list[Any]:
    """Run replica k on inputs[k] on its own thread (replica 0 on the caller's); re-raise the first error."""
    grad_enabled = torch.is_grad_enabled()
    autocast = [
        (kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)
    ]
    cpu_replicas = sum(d.type == "cpu" for d in devices)
    caller_threads = torch.get_num_threads()
    # CPU replicas split the caller's cores; a fresh thread must set its own count (DESIGN.md rule 4).
    threads_each = max(1, caller_threads // max(1, cpu_replicas))
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def run(k: int) -> None:
        try:
            device = devices[k]
            if device.type == "cpu":
                set_thread_intraop_threads(threads_each)
            elif device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad_enabled), contextlib.ExitStack() as stack:
                for kind, dtype in autocast:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
                results[k] = replicas[k](*inputs[k], **kwargs[k])
        except BaseException as error:
            errors[k] = error

    threads = [
        threading.Thread(target=run, args=(k,), name=f"threadpar-dp-replica-{k}")
        for k in range(1, len(replicas))
    ]
    for t in threads:
        t.start()
    try:
        run(0)
    finally:
        for t in threads:
            t.join()
        torch.set_num_threads(caller_threads)
    for k, error in enumerate(errors):
        if error is not None:
            if hasattr(error, "add_note"):
                error.add_note(f"(raised in DataParallel replica {k} on {devices[k]})")
            raise error
    return results


class DataParallel(nn.Module):
    """Single-process data parallelism over devices from one thread; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: DeviceIds = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ConfigError(f"dim must be an int, got {dim!r}")
        self.module = module
        self.device_ids = resolve_devices(device_ids)
        self.src_device = self.device_ids[0]
        if output_device is None:
            self.output_device = self.src_device
        elif isinstance(output_device, int) and not isinstance(output_device, bool):
            self.output_device = torch.device("cuda", output_device)
        else:
            self.output_device = torch.device(output_device)
        self.dim = dim
        self._check_on_source()

    def _check_on_source(self) -> None:
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if t.device != self.src_device:
                raise ConfigError(
                    f"DataParallel: the module must be on device_ids[0] ({self.src_device}) but '{name}' is on "
                    f"{t.device}; call module.to('{self.src_device}') first"
                )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_on_source()
        if not inputs and not kwargs:
            return self.module()
        per_inputs, per_kwargs = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
        devices = self.device_ids[: len(per_inputs)]
        if len(devices) == 1:
            return self.module(*per_inputs[0], **per_kwargs[0])
        replicas = [self.module] + [replicate(self.module, d, self.src_device) for d in devices[1:]]
        outputs = parallel_apply(replicas, per_inputs, per_kwargs, devices)
        return gather(outputs, self.output_device, self.dim)
