"""An exception raised into autograd's engine during a backward on the double's GPUs reaches backward's caller.

On a GPU, an exception a Python callback raises inside backward (a gradient hook, a __torch_dispatch__ of an op
that a node's backward runs, a callback queued with `queue_callback`) leaves the engine as torch's
`python_error`: it unwinds the node's stream guard (torch/csrc/autograd/engine.cpp, Engine::evaluate_function,
`c10::OptionalStreamGuard parent_stream_guard`; GraphTask::exec_post_processing's `c10::MultiStreamGuard` around
the final callbacks), the engine persists it (python_engine.cpp, PythonEngine::thread_on_exception), and
backward() raises it. CUDA's guard is C++. The double's device guard is torch's Python one (torch/csrc/acc/
Module.cpp, PythonDeviceGuard), whose `exchangeStream`, called by the stream guard's destructor and noexcept,
asks Python for the device type while the callback's exception is still pending in the interpreter: that call
fails and the process terminates (std::terminate), every rank and the test run with it.

So where the engine itself calls Python during a backward, the double takes the exception there (`carry`), hands
the engine a value its own C++ checks refuse (a C++ error, with no Python exception pending, which unwinds the
guards as CUDA's would), and `carrying`'s backward raises the original exception at backward's caller, with its
own traceback. The entry points: the double's `__torch_dispatch__`s (the device's, fake_device.DeviceTouch's, and
any mode a test runs under backward: `dispatch_boundary`), tensor hooks and post-accumulate-grad hooks (wrapped
as registered), and queued callbacks. Not covered: hooks registered on a graph node itself
(`grad_fn.register_hook` / `register_prehook`, C++ methods no Python wrapper can reach).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

_local = threading.local()  # .carried: one slot per backward running on this thread, innermost last
_engine_code: list[CodeType] = []  # the frame that calls the C++ engine runs this code

# torch's wrappers between the engine and a callback, which hand its result back unchanged: a mode's
# __torch_dispatch__ runs inside torch._disable_dynamo (torch/utils/_python_dispatch.py,
# TorchDispatchMode.__init_subclass__), whose frames are torch/_compile.py's `inner` and, in it,
# torch/_dynamo/eval_frame.py's `_fn` (DisableContext)
_TORCH = os.path.dirname(torch.__file__)
_PASS_THROUGH = frozenset(
    {
        (os.path.join(_TORCH, "_compile.py"), "inner"),
        (os.path.join(_TORCH, "_dynamo", "eval_frame.py"), "_fn"),
    }
)


class _Refused:
    """What a __torch_dispatch__ hands the engine in place of raising: not a tensor, so the dispatcher's C++
    conversion of the result fails (python_arg_parser: "Unable to cast ... to Tensor"), a C++ error."""


REFUSED = _Refused()


def _refused_gradient() -> torch.Tensor:
    """What a gradient hook returns in place of raising: a tensor of a type no gradient has, which the engine's
    C++ check of a hook's result refuses (torch/csrc/autograd/function_hook.cpp, check_variable_result: "hook
    ... has changed the type of value")."""
    return torch.zeros((0,) * 8, dtype=torch.bool)


def carry(error: BaseException, caller: FrameType | None) -> bool:
    """Whether `error`, raised in a Python callback that `caller` (the frame below it) called, is to be carried
    past the engine: the callback was called by the engine itself (its Python caller is the frame that entered
    the C++ engine, torch's pass-through wrappers aside) during a backward on this thread. If so, the
    backward's first such error is kept."""
    slots = getattr(_local, "carried", None)
    if not slots or not _engine_code:
        return False
    while caller is not None and (caller.f_code.co_filename, caller.f_code.co_name) in _PASS_THROUGH:
        caller = caller.f_back
    if caller is None or caller.f_code is not _engine_code[0]:
        return False
    if slots[-1] is None:
        slots[-1] = error
    return True


def carrying(run_backward: Callable[..., Any]) -> Callable[..., Any]:
    """torch's `_engine_run_backward` (the function whose frame enters the C++ engine), raising what `carry`
    kept instead of the engine's own error."""
    if not _engine_code:
        _engine_code.append(run_backward.__code__)
    elif _engine_code[0] is not run_backward.__code__:
        raise RuntimeError("the double carries errors past one engine entry point only")

    @functools.wraps(run_backward)
    def run(*args: Any, **kwargs: Any) -> Any:
        slots = getattr(_local, "carried", None)
        if slots is None:
            slots = _local.carried = []
        slots.append(None)
        try:
            result = run_backward(*args, **kwargs)
        except BaseException:
            carried = slots.pop()
            if carried is None:
                raise
            raise carried from None
        carried = slots.pop()
        if carried is not None:  # (a queued callback's: the engine finished)
            raise carried from None
        return result

    return run


def dispatch_boundary(method: Callable[..., Any]) -> Callable[..., Any]:
    """For a `__torch_dispatch__` (a subclass's, before classmethod; a mode's): its error carried past the engine
    when the engine called it."""

    @functools.wraps(method)
    def dispatch(owner: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return method(owner, func, types, args, kwargs)
        except BaseException as error:
            if carry(error, sys._getframe(1)):
                return REFUSED
            raise

    return dispatch


def _gradient_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        try:
            return hook(*args)
        except BaseException as error:
            if carry(error, sys._getframe(1)):
                return _refused_gradient()
            raise

    return run


def _callback(callback: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(callback)
    def run() -> Any:
        try:
            return callback()
        except BaseException as error:
            if carry(error, sys._getframe(1)):
                return None  # (the engine ignores a callback's result: it finishes, and backward raises)
            raise

    return run


class _Engine:
    """torch's autograd engine (`Variable._execution_engine`), whose queued callbacks are wrapped."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def queue_callback(self, callback: Callable[[], Any]) -> None:
        self._engine.queue_callback(_callback(callback))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def install() -> None:
    """Wrap gradient hooks as they are registered, and queued callbacks (once per process: sim_gpu.install)."""
    register_hook = torch.Tensor.register_hook
    register_post_accumulate_grad_hook = torch.Tensor.register_post_accumulate_grad_hook

    def hook(self: torch.Tensor, fn: Callable[..., Any]) -> Any:
        return register_hook(self, _gradient_hook(fn))

    def post_accumulate_grad_hook(self: torch.Tensor, fn: Callable[..., Any]) -> Any:
        return register_post_accumulate_grad_hook(self, _gradient_hook(fn))

    functools.update_wrapper(hook, register_hook)
    functools.update_wrapper(post_accumulate_grad_hook, register_post_accumulate_grad_hook)
    torch.Tensor.register_hook = hook  # type: ignore[method-assign]
    torch.Tensor.register_post_accumulate_grad_hook = post_accumulate_grad_hook  # type: ignore[method-assign]
    variable = torch.autograd.variable.Variable
    variable._execution_engine = _Engine(variable._execution_engine)  # type: ignore[attr-defined]
