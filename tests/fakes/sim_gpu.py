"""The double's GPUs as a device of their own: tensors on `simgpu:i`, backed by host memory.

A GPU tensor is not a host tensor: torch refuses to mix it with host tensors, reading its value on the host is
a copy that waits for the device, and code branches on its device type. So the double's device tensors are
tensors of a distinct device, `simgpu:i` (torch's PrivateUse1 key, renamed: torch/utils/backend_registration.py,
`_setup_privateuseone_for_python_backend`, which this follows), and each is a wrapper subclass (as FakeTensor and
DTensor are: `torch.Tensor._make_wrapper_subclass`) around a host tensor that holds its memory (`host(t)`).

Why not the device type "cuda": autograd asks the device's guard for its streams
(torch/csrc/autograd/input_metadata.cpp, `InputMetadata`: `getDeviceGuardImpl(device.type())->getStream`), and
a CPU build of torch registers no CUDA guard (c10/core/impl/DeviceGuardImplInterface.h, getDeviceGuardImpl:
"PyTorch is not linked with support for cuda devices", which terminates the process from backward); only
PrivateUse1 takes a guard from Python (torch/csrc/acc/Module.cpp). So code meant for the double and a GPU names
its device through threadpar (`threadpar.get_device()`: cuda:i on a GPU, simgpu:i here) or `torch.accelerator`,
not the string "cuda".

What the device does, each rule after the CUDA or torch source it mirrors:
- Every op on a device tensor runs on its host memory, on the host (`_compute`), after the device check torch's
  kernels make (TensorIterator, aten/src/ATen/TensorIterator.cpp `compute_types`: "Expected all tensors to be on
  the same device"; its Python model, torch/_subclasses/fake_tensor.py `FakeTensor._find_common_device`): all
  device tensors on one device; a host tensor only as a 0-dim scalar (a kernel argument); the copies are the
  only ops that cross devices.
- A copy between host and device (`copy_`, `.to`, `.cpu()`, `.item()`, `.tolist()`) is what
  aten/src/ATen/native/cuda/Copy.cu `copy_kernel_cuda` does: with `non_blocking=True` and pinned host memory,
  an asynchronous copy ordered on the current stream; otherwise `at::cuda::memcpy_and_sync`, a copy followed by
  `cudaStreamSynchronize` of the current stream, which the host waits for and which a capture refuses
  (cudaErrorStreamCaptureUnsupported, 900). The stream part is the thread's FakeCuda's (`copies.py` in
  fake_cuda_nccl's terms: `on_copy`); a thread bound to none copies at once, as an idle GPU would.
- Random ops draw from the device's default generator, one per device index (torch/cuda/random.py: a generator
  per device, `torch.cuda.manual_seed` seeds the current device's), not the host's.
- Pinned host memory (`pin_memory()`, `is_pinned()`) is host memory the double remembers as pinned.
- The current device is per thread, 0 until `set_device` (c10/cuda/CUDAFunctions.cpp, cudaSetDevice is
  per-thread); a factory given `device="simgpu"` without an index uses it.

Limits: `torch.Generator(device="simgpu")` cannot be made (torch/csrc/acc/Module.cpp: the Python hooks leave
getNewGenerator unimplemented), so a rank's generator on the double is a host generator, which the device's ops
accept; `data_ptr()` and `untyped_storage()` from Python give its host memory, C++ sees no storage (a wrapper
has none of its own); every op costs a Python call; timings, memory limits and kernels' numerics are the host's.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._mode_utils import no_dispatch

from . import sim_gpu_autocast, sim_gpu_engine, sim_gpu_streams

DEVICE_TYPE = "simgpu"
DEVICE_COUNT = 8  # the double's GPUs per process (a node's worth; ranks beyond share them round-robin)

_install_lock = threading.Lock()
_installed: list[bool] = []
_DEVICES: list[torch.device] = []  # simgpu:0 .. simgpu:DEVICE_COUNT-1, made once at install


def install() -> None:
    """Register the device with torch, once per process (PrivateUse1 is renamed once: torch refuses twice)."""
    with _install_lock:
        if _installed:
            return
        if torch._C._get_privateuse1_backend_name() != "privateuseone":
            raise RuntimeError(
                f"the double's device needs torch's PrivateUse1 key, which this process already gave to "
                f"{torch._C._get_privateuse1_backend_name()!r}"
            )
        torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        torch.utils.generate_methods_for_privateuse1_backend()  # Tensor.simgpu(), Module.simgpu(), is_simgpu
        torch._register_device_module(DEVICE_TYPE, _DeviceModule())
        torch._C._acc.register_python_privateuseone_hook(_Hooks())
        torch._C._acc.register_python_privateuseone_device_guard(_Guard())
        _DEVICES.extend(torch.device(DEVICE_TYPE, i) for i in range(DEVICE_COUNT))
        _register_kernels()
        sim_gpu_autocast.register(DEVICE_TYPE)
        _backward_without_device_threads()
        sim_gpu_engine.install()
        _pinned_memory_methods()
        _installed.append(True)


def device(index: int) -> torch.device:
    """The double's GPU `index` (the device is registered with torch on first use)."""
    if not _installed:
        install()
    if not 0 <= index < DEVICE_COUNT:
        raise ValueError(
            f"{DEVICE_TYPE}:{index}: the double has {DEVICE_COUNT} GPUs per process (0..{DEVICE_COUNT - 1})"
        )
    return _DEVICES[index]


def is_device(t: object) -> bool:
    return isinstance(t, DeviceTensor)


def host(t: torch.Tensor) -> torch.Tensor:
    """The host tensor holding a device tensor's memory (a host tensor itself for any other tensor)."""
    return t._host if isinstance(t, DeviceTensor) else t


# -- the calling thread's current device and FakeCuda -----------------------------------------------------------------
_local = threading.local()


def current_device() -> int:
    return getattr(_local, "device", 0)


def set_device(index: int | torch.device | str) -> None:
    if not isinstance(index, int):
        given = torch.device(index)
        if given.type != DEVICE_TYPE:
            raise ValueError(f"set_device: {given} is not a {DEVICE_TYPE} device")
        index = current_device() if given.index is None else given.index
    if not 0 <= index < DEVICE_COUNT:
        raise RuntimeError(
            f"{DEVICE_TYPE} error: invalid device ordinal {index} (the double has {DEVICE_COUNT})"
        )
    _local.device = index


class CopyModel(Protocol):
    """A copy between host and device on the streams: the thread's FakeCuda implements it (a synchronous copy
    waits for the current stream and is refused in a capture; an asynchronous one is a kernel on it). `dst`
    and `src` are host memory; `index` the GPU. A thread bound to none copies at once (an idle GPU)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, what: str, sync: bool, index: int) -> None: ...


def bind(model: CopyModel | None) -> CopyModel | None:
    """Make `model` the calling thread's copy model (a rank thread's FakeCuda); returns the one it replaces."""
    previous = getattr(_local, "model", None)
    _local.model = model
    return previous


_process_model: list[
    CopyModel
] = []  # the process's default while simulated_gpus runs; guarded by _model_lock
_model_lock = threading.Lock()


def bound() -> CopyModel | None:
    """The calling thread's copy model: its own binding, else the process's (a launch on the double's GPUs
    through threadpar.launch: fake_cuda_nccl.simulated_gpus)."""
    model = getattr(_local, "model", None)
    if model is None and _process_model:
        with _model_lock:
            model = _process_model[-1] if _process_model else None
    return model


@contextlib.contextmanager
def process_model(model: CopyModel) -> Iterator[None]:
    """While open, threads bound to no copy model use `model`."""
    with _model_lock:
        _process_model.append(model)
    try:
        yield
    finally:
        with _model_lock:
            _process_model.remove(model)


# -- generators: one default per device index --------------------------------------------------------------------------
_generators_lock = threading.Lock()
_generators: dict[int, torch.Generator] = {}


def default_generator(index: int) -> torch.Generator:
    """Device `index`'s default generator (torch.cuda.default_generators[index]); a host generator here."""
    with _generators_lock:
        generator = _generators.get(index)
        if generator is None:
            generator = _generators[index] = torch.Generator()
            generator.manual_seed(
                torch.initial_seed()
            )  # as CUDA's, seeded from the default seed on first use
        return generator


# -- pinned host memory ---------------------------------------------------------------------------------------------------
_pinned_lock = threading.Lock()
_pinned: dict[int, int] = {}  # host storage address -> pinned tensors alive on it


def is_pinned(t: torch.Tensor) -> bool:
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    with _pinned_lock:
        return t.untyped_storage().data_ptr() in _pinned


def _pin(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host tensor `t` (cudaHostAlloc'd memory in torch: aten/src/ATen/native/Memory.cpp)."""
    pinned = torch.empty_like(t, memory_format=torch.contiguous_format)
    pinned.copy_(t)
    address = pinned.untyped_storage().data_ptr()
    with _pinned_lock:
        _pinned[address] = _pinned.get(address, 0) + 1
    weakref.finalize(pinned.untyped_storage(), _unpin, address)
    return pinned


def _unpin(address: int) -> None:
    with _pinned_lock:
        left = _pinned.get(address, 0) - 1
        if left > 0:
            _pinned[address] = left
        else:
            _pinned.pop(address, None)


# -- device tensors ---------------------------------------------------------------------------------------------------
class DeviceTensor(torch.Tensor):
    """A tensor on `simgpu:i`: a wrapper whose memory is the host tensor `_host` (same sizes, strides, offset)."""

    _host: (
        torch.Tensor
    )  # (an attribute, not a slot: nn.Module.to swaps a parameter's class and attributes with
    # torch.utils.swap_tensors, which refuses classes whose slots differ)

    @staticmethod
    def __new__(cls, host_tensor: torch.Tensor, index: int) -> DeviceTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            host_tensor.size(),
            strides=host_tensor.stride(),
            storage_offset=host_tensor.storage_offset(),
            dtype=host_tensor.dtype,
            device=_DEVICES[index],
            storage_size=_VIRTUAL_BYTES,
        )
        wrapper._host = host_tensor
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # (no host read: a repr must not sync)
        return f"tensor(<{DEVICE_TYPE}:{self.device.index} {tuple(self.shape)} {self.dtype}>)"

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        return ["_host"], self.device.index  # type: ignore[return-value]

    @staticmethod
    def __tensor_unflatten__(inner: dict, index: int, outer_size: Any, outer_stride: Any) -> DeviceTensor:
        return DeviceTensor(inner["_host"], index)

    # No Python layer above the dispatcher: a GPU tensor has none (and it costs a call per op); the device is
    # all in __torch_dispatch__, below autograd.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    @sim_gpu_engine.dispatch_boundary  # (an error raised into autograd's engine: sim_gpu_engine.py)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    # A wrapper has no storage of its own (torch.Tensor._make_wrapper_subclass): Python code that compares or
    # views memory (data_ptr, untyped_storage: threadpar's bucket and span checks) is given the host memory that
    # holds the device tensor, at the same addresses a GPU's would be compared. C++ callers get torch's refusal.
    def data_ptr(self) -> int:
        return self._host.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._host.untyped_storage()

    def __deepcopy__(self, memo: dict) -> DeviceTensor:
        """A copy of the memory on the device. torch's Tensor.__deepcopy__ (torch/_tensor.py) copies a tensor's
        storage, and clones only a wrapper that has none: this one's storage is its host memory's
        (untyped_storage, below), which that path would make a host storage of the device tensor."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:  # (torch/_tensor.py, Tensor.__deepcopy__)
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at "
                "the moment."
            )
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for name, value in self.__dict__.items():  # (a parameter's mark, _is_param, and any other attribute)
            if name != "_host":
                setattr(new, name, copy.deepcopy(value, memo))
        memo[id(self)] = new
        return new

    # `t.data = new`: t takes new's memory (torch/csrc/autograd/variable.cpp, VariableHooks::set_data:
    # `shallow_copy_from(new_data)`, storage included). torch copies the wrapper's metadata; its memory is the
    # Python attribute `_host`, which follows here (threadpar's ZeRO and DDP make parameters views this way).
    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        torch.Tensor.data.__set__(self, new)  # type: ignore[attr-defined]  # (torch's checks and metadata)
        self._host = host(new)

    def tolist(self) -> Any:
        # torch/csrc/utils/tensor_list.cpp, tensor_to_list: a tensor not on the host is copied there first
        return self.cpu().tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        # torch/csrc/utils/tensor_numpy.cpp, tensor_to_numpy: TORCH_CHECK_TYPE on the device type
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )


def wrap(host_tensor: torch.Tensor, index: int) -> DeviceTensor:
    return DeviceTensor(host_tensor, index)


# A wrapper's own storage is never allocated; it is given this many bytes so that its sizes, strides and offset
# can follow its host tensor's anywhere (_match_host), as an op resizes or re-strides it (out=, resize_, set_).
_VIRTUAL_BYTES = 1 << 60


def _match_host(t: DeviceTensor) -> None:
    """Give wrapper `t` its host tensor's sizes, strides and offset, after an op changed them there (an out= op
    resizing its output, resize_, set_): set on the wrapper itself with the meta kernel of as_strided_, as
    torch's return_and_correct_aliasing does for inplace_view ops (torch/utils/_python_dispatch.py)."""
    h = t._host
    if t.shape == h.shape and t.stride() == h.stride() and t.storage_offset() == h.storage_offset():
        return
    with no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.as_strided_.default(t, h.size(), h.stride(), h.storage_offset())
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


# -- dispatch ---------------------------------------------------------------------------------------------------------
aten = torch.ops.aten

# Ops whose tensor arguments may be on other devices (they move data between devices or read indices anywhere).
# aten/src/ATen/native/TensorAdvancedIndexing.cpp: index/index_put move host indices to self's device
# (make_info: `indices ... .to(self.device())`).
_CROSS_DEVICE = frozenset(
    {aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default, aten.index_put.default}
)


class _OpInfo:
    """What the device needs to know of an op, from its schema, once."""

    __slots__ = ("generator", "returned", "written")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        arguments = schema.arguments
        # the (position, name) of every argument the op writes (in place, out=, an inplace_view op)
        self.written = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        # for each return: the (position, name) of the written argument it is (an in-place or out= op returns
        # its argument itself: the caller gets the same tensor back), or None (a new tensor, or a view)
        returned = []
        for r in schema.returns:
            alias = r.alias_info
            found = None
            if alias is not None and alias.is_write:
                found = next(
                    (
                        (i, a.name)
                        for i, a in enumerate(arguments)
                        if a.alias_info is not None and a.alias_info.before_set == alias.before_set
                    ),
                    None,
                )
            returned.append(found)
        self.returned: tuple[tuple[int, str] | None, ...] | None = (
            tuple(returned) if any(r is not None for r in returned) else None
        )
        # the position and name of a Generator? argument, if the op draws random numbers
        self.generator: tuple[int, str] | None = next(
            ((i, a.name) for i, a in enumerate(arguments) if "Generator" in str(a.type)), None
        )


_INFO: dict[Any, _OpInfo] = {}


def _info(func: Any) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)  # (a dict store: a race only computes it twice)
    return info


# Set by fake_device: `check(func, args, kwargs)` waits for (or reports as a race) a pending NCCL operation or
# asynchronous copy whose buffers a device op touches. The double runs every op at once, on the host, so a device
# op ordered after a pending kernel on its stream must wait for it here, where a GPU's stream would.
_op_check: list[Callable[[Any, tuple, dict], None]] = []


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if _op_check:
        _op_check[0](func, args, kwargs)
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)
    if func.namespace in _COMMUNICATION:
        return func.redispatch(_DEVICE_KERNEL, *args, **kwargs)
    return _compute(func, args, kwargs)


# torch.distributed's ops (functional collectives, their waits) have kernels for any device (torch/csrc/distributed/
# c10d/Functional.cpp: CompositeExplicitAutograd) that call the process group with the tensors themselves, and find
# a collective's Work by its output tensor (wait_tensor): on the double, its device tensors, never their memory
_COMMUNICATION = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
_DEVICE_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


class _Devices:
    """The devices an op's tensor arguments are on, checked as torch's kernels check them."""

    __slots__ = ("device", "func", "host", "host_indices")

    def __init__(self, func: Any) -> None:
        self.func = func
        self.device: torch.device | None = None  # the device tensors' device
        self.host: torch.Tensor | None = None  # a host tensor that is not a 0-dim scalar
        self.host_indices = False  # an indexing op's host indices (copied to the device: _copy_host_indices)

    def unwrap(self, value: Any) -> Any:
        if type(value) is DeviceTensor:
            if self.device is None:
                self.device = value.device
            elif value.device != self.device:
                _mismatch(self.device, value.device)
            return value._host
        if isinstance(value, torch.Tensor):
            if isinstance(value, DeviceTensor):  # (a subclass of it: as itself)
                return self.unwrap_device(value)
            if self.host is None and value.device.type == "cpu" and value.dim() != 0:
                self.host = value
            return value
        if type(value) in (list, tuple) and value and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self.unwrap(v) for v in value)
        return value

    def unwrap_device(self, value: DeviceTensor) -> torch.Tensor:
        if self.device is None:
            self.device = value.device
        elif value.device != self.device:
            _mismatch(self.device, value.device)
        return value._host

    def check(self) -> None:
        if self.host is not None and self.device is not None:
            if self.func not in _CROSS_DEVICE:
                _mismatch(self.device, self.host.device)
            self.host_indices = True


def _mismatch(a: torch.device, b: torch.device) -> None:
    raise RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! (the "
        "double's device checks tensors as torch's kernels do: a host tensor enters a device op only as a "
        "0-dim scalar; move it with .to(device) first)"
    )


def _compute(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on the host memory of its device tensors, and give back device tensors: new wrappers for new
    tensors and views, the very arguments for what an in-place or out= op returns (their sizes following the
    host's: _match_host)."""
    devices = _Devices(func)
    unwrap = devices.unwrap
    host_args = tuple([unwrap(a) for a in args])
    host_kwargs = {k: unwrap(v) for k, v in kwargs.items()} if kwargs else kwargs
    devices.check()
    if devices.host_indices and bound() is not None:
        _copy_host_indices(devices, host_args, host_kwargs)
    target = devices.device
    made_on = host_kwargs.get("device") if host_kwargs else None
    if made_on is not None:  # (a factory-like op: new_empty, *_like)
        target = _normalize(torch.device(made_on))
        host_kwargs["device"] = _HOST
    info = _info(func)
    if info.generator is not None and target is not None and target.type == DEVICE_TYPE:
        host_args = _use_device_generator(info.generator, host_args, host_kwargs, target.index)
    out = func(*host_args, **host_kwargs)
    for position, name in info.written:
        written = args[position] if position < len(args) else kwargs.get(name)
        for w in written if isinstance(written, (list, tuple)) else (written,):
            if isinstance(w, DeviceTensor):
                _match_host(w)
    if target is None or target.type != DEVICE_TYPE:
        return out
    index = target.index
    if info.returned is None:
        return DeviceTensor(out, index) if type(out) is torch.Tensor else _wrap_outputs(out, index)
    outs = out if isinstance(out, tuple) else (out,)
    results = []
    for value, source in zip(outs, info.returned):
        if source is not None:
            position, name = source
            results.append(args[position] if position < len(args) else kwargs[name])
        else:
            results.append(_wrap_outputs(value, index))
    return tuple(results) if isinstance(out, tuple) else results[0]


_HOST = torch.device("cpu")


def _copy_host_indices(devices: _Devices, args: tuple, kwargs: dict) -> None:
    """An indexing op moves host indices to the device first (AdvancedIndex's constructor, aten/src/ATen/native/
    TensorAdvancedIndexing.cpp: `indice.to(src.device())`), a synchronous host-to-device copy: modelled as one,
    for its wait and its refusal in a capture (the indices themselves are read on the host here)."""
    model = bound()
    assert model is not None and devices.device is not None
    for value in [*args, *kwargs.values()]:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() != 0:
                model.copy(t, t, "a host-to-device copy of indices", True, devices.device.index)


def _normalize(given: torch.device) -> torch.device:
    if given.type == DEVICE_TYPE and given.index is None:
        return torch.device(DEVICE_TYPE, current_device())
    return given


def _wrap_outputs(out: Any, index: int) -> Any:
    if isinstance(out, torch.Tensor):
        return DeviceTensor(out, index)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_outputs(o, index) for o in out)
    return out


def _use_device_generator(slot: tuple[int, str], args: tuple, kwargs: dict, index: int) -> tuple:
    """A random op given no generator draws from the device's (kwargs updated in place; returns the args)."""
    position, name = slot
    if position < len(args):
        if args[position] is None:
            return (*args[:position], default_generator(index), *args[position + 1 :])
    elif kwargs.get(name) is None:
        kwargs[name] = default_generator(index)
    return args


# -- the special ops: copies, host reads, random ops without a generator argument ---------------------------------------
def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """aten::copy_(self, src, non_blocking=False): the one op that moves data between devices."""
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    _copy_memory(dst, src, non_blocking)
    return dst


def _copy_memory(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """dst <- src (any devices): a copy touching the host goes through the thread's CopyModel (Copy.cu
    copy_kernel_cuda: synchronous unless non_blocking with pinned host memory)."""
    to_device, from_device = isinstance(dst, DeviceTensor), isinstance(src, DeviceTensor)
    model = bound()
    if to_device != from_device and model is not None:
        host_side = src if to_device else dst
        sync = not (non_blocking and is_pinned(host_side))
        what = "a host-to-device copy" if to_device else "a device-to-host copy"
        index = (dst if to_device else src).device.index
        source = host(src)
        if source.dtype != dst.dtype or source.shape != dst.shape:  # (copy_ converts and broadcasts)
            with torch.no_grad():
                source = source.to(dst.dtype).expand(dst.shape).contiguous()
        model.copy(host(dst), source, what, sync, index)
        return
    with torch.no_grad():
        host(dst).copy_(host(src))


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """aten::_to_copy(self, *, dtype, layout, device, pin_memory, non_blocking, memory_format): a new tensor,
    made on the target device and filled by copy_ (aten/src/ATen/native/TensorConversions.cpp, _to_copy)."""
    src = args[0]
    target = _normalize(torch.device(kwargs["device"])) if kwargs.get("device") is not None else src.device
    dtype = kwargs.get("dtype") or src.dtype
    memory_format = kwargs.get("memory_format") or torch.preserve_format
    out = torch.empty_like(host(src), dtype=dtype, memory_format=memory_format)
    if target.type == DEVICE_TYPE:
        result: torch.Tensor = DeviceTensor(out, target.index)  # type: ignore[arg-type]
    else:
        result = _pin(out) if kwargs.get("pin_memory") else out
    _copy_memory(result, src, bool(kwargs.get("non_blocking", False)))
    return result


def _local_scalar_dense(func: Any, args: tuple, kwargs: dict) -> Any:
    """`.item()`: a copy of one element to the host, then a stream synchronize (CUDAScalar.cu,
    _local_scalar_dense_cuda: at::cuda::memcpy_and_sync)."""
    t = args[0]
    model = bound()
    if model is None:
        return host(t).item()
    value = torch.empty((), dtype=t.dtype)
    model.copy(value, host(t).reshape(()), "a device-to-host copy (.item())", True, t.device.index)
    return value.item()


def _native_dropout(func: Any, args: tuple, kwargs: dict) -> Any:
    """aten::native_dropout draws from the device's default generator (it takes none): a Bernoulli mask from
    it, scaled as aten/src/ATen/native/Dropout.cpp does on every backend."""
    x, p, train = args[0], float(args[1]), args[2] if len(args) > 2 else kwargs.get("train")
    index = x.device.index
    hx = host(x)
    if train is False or p == 0.0:
        return DeviceTensor(hx.clone(), index), DeviceTensor(torch.ones_like(hx, dtype=torch.bool), index)
    mask = torch.empty_like(hx, dtype=torch.bool).bernoulli_(1.0 - p, generator=default_generator(index))
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return DeviceTensor(hx * mask * scale, index), DeviceTensor(mask, index)


def _set_storage(func: Any, args: tuple, kwargs: dict) -> Any:
    """aten::set_.source_Storage*(self, source, ...): self takes the storage's memory. A device tensor's
    storage is its host memory here (DeviceTensor.untyped_storage), so `t.set_(buffer.untyped_storage(), ...)`
    (threadpar's packed pipeline messages) gives t that memory; torch would refuse a host storage for a
    device tensor, which the double cannot tell apart."""
    t = args[0]
    with torch.no_grad():
        func(t._host, *args[1:], **kwargs)
    _match_host(t)
    return t


_SPECIAL: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    aten.copy_.default: _copy,
    aten._to_copy.default: _to_copy,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.native_dropout.default: _native_dropout,
    aten.set_.source_Storage: _set_storage,
    aten.set_.source_Storage_storage_offset: _set_storage,
}


# -- kernels for the PrivateUse1 key: what reaches the device without a device tensor in hand ----------------------------
def _register_kernels() -> None:
    lib = torch.library.Library("aten", "IMPL")

    def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        index = _normalize(torch.device(device)).index
        return DeviceTensor(torch.empty(size, dtype=dtype, memory_format=memory_format), index)

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        index = _normalize(torch.device(device)).index
        return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype), index)

    def copy_from(src, dst, non_blocking=False):  # aten::_copy_from(self, dst, non_blocking): dst <- self
        _copy(aten.copy_.default, (dst, src, non_blocking), {})
        return dst

    def copy_from_and_resize(src, dst):
        host(dst).resize_(src.shape)
        return copy_from(src, dst)

    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")
    _libraries.append(lib)


def _pinned_memory_methods() -> None:
    """Tensor.pin_memory / is_pinned on the double's device. torch pins through the accelerator's host allocator
    (aten/src/ATen/native/Memory.cpp: _pin_memory asks `getPinnedMemoryAllocator`, is_pinned `isPinnedPtr`),
    which a backend registered from Python cannot provide (torch/csrc/acc/Module.cpp leaves both to the base
    hooks, which raise or say False); so the methods are wrapped: on a machine whose real accelerator is there
    (a GPU), they are torch's own."""
    original_pin, original_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    # (with a PrivateUse1 backend registered, torch's default accelerator is it: aten/src/ATen/
    # DeviceAccelerator.cpp, getAccelerator, "Whenever a PrivateUse1 device is registered, use it first"; so a
    # real GPU's pinning is asked for by name)
    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
            return original_pin(self, "cuda")
        return _pin(self)

    def tensor_is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        if is_pinned(self):
            return True
        return torch.cuda.is_available() and original_is_pinned(self, "cuda")

    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.Tensor.is_pinned = tensor_is_pinned  # type: ignore[method-assign]


_libraries: list[Any] = []


def _backward_without_device_threads() -> None:
    """A backward from device tensors runs on the calling thread (as with autograd multithreading off).

    torch's engine would hand their nodes to its worker thread of the node's device, but it learns how many
    devices there are from the device guard (torch/csrc/autograd/engine.cpp, Engine::start_device_threads,
    `deviceCount()`), which is 1 for a guard registered from Python (torch/csrc/acc/Module.cpp,
    PythonDeviceGuard::deviceCount): a node on simgpu:1 fails engine.cpp's `device.index() <
    device_ready_queues_.size()` assert. So the double runs a device tensor's backward on the calling thread,
    and models the device thread itself where a test asks for it (fake_autograd_thread.py, on top of this)."""
    # (an error raised inside the engine reaches the caller: sim_gpu_engine.py)
    original = sim_gpu_engine.carrying(torch.autograd.graph._engine_run_backward)

    def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch._C._is_multithreading_enabled() or not any(_on_device(t) for t in t_outputs):
            return original(t_outputs, *args, **kwargs)
        torch._C._set_multithreading_enabled(False)
        try:
            return original(t_outputs, *args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(True)

    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward  # type: ignore[attr-defined]  # (imported by name there)


def _on_device(root: Any) -> bool:
    """Whether a backward's root (a tensor or a GradientEdge) is on the double's device. An edge's device is
    its node's input metadata, as torch/autograd/__init__.py, _make_grads, reads it."""
    if isinstance(root, torch.autograd.graph.GradientEdge):
        return root.node._input_metadata[root.output_nr].device.type == DEVICE_TYPE
    return isinstance(root, DeviceTensor)


# -- what torch asks a PrivateUse1 backend for ------------------------------------------------------------------------
class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


class _DeviceModule:
    """`torch.simgpu`: the part of torch.cuda's module API that code reaches through torch.get_device_module."""

    # streams and events: the calling rank thread's FakeCuda's (sim_gpu_streams.py)
    Stream = sim_gpu_streams.Stream
    Event = sim_gpu_streams.Event
    current_stream = staticmethod(sim_gpu_streams.current_stream)
    stream = staticmethod(sim_gpu_streams.stream)
    synchronize = staticmethod(sim_gpu_streams.synchronize)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return DEVICE_COUNT

    @staticmethod
    def current_device() -> int:
        return current_device()

    @staticmethod
    def set_device(index: int | torch.device | str) -> None:
        set_device(index)

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """What torch.autocast accepts on the device (torch/amp/autocast_mode.py asks a PrivateUse1 module): a
        GPU's half types. The casts are CUDA's (sim_gpu_autocast.py)."""
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def manual_seed(seed: int) -> None:
        """torch.cuda.manual_seed: the current device's generator."""
        default_generator(current_device()).manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        for index in range(DEVICE_COUNT):
            default_generator(index).manual_seed(seed)

    @staticmethod
    def get_rng_state(device: int | str | torch.device = DEVICE_TYPE) -> torch.Tensor:
        return default_generator(_index_of(device)).get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: int | str | torch.device = DEVICE_TYPE) -> None:
        default_generator(_index_of(device)).set_state(state)


def _index_of(given: int | str | torch.device) -> int:
    if isinstance(given, int):
        return given
    d = torch.device(given)
    return current_device() if d.index is None else d.index


def to_host(value: Any) -> Any:
    """`value` with every device tensor in it (in lists, tuples, dicts) copied to the host (for comparing a
    finished launch's results with a host reference)."""
    if isinstance(value, DeviceTensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    return value
