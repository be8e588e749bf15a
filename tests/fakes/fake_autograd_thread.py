"""Backward on a device thread, as CUDA autograd runs it: the double's `autograd_thread` mode.

torch's autograd engine runs the CPU part of a backward on the thread that called it, but every CUDA device
has a worker thread of its own (torch/csrc/autograd/engine.cpp: Engine::start_device_threads starts one
thread per device, `thread_main` runs the graph tasks' ready queue of its device; Engine::execute hands
the work to the device's queue and the calling thread waits on the graph task's future). So on a GPU,
gradient hooks (post-accumulate-grad hooks: DDP's reducer, ZeRO-2's staging) and callbacks queued with
`queue_callback` run on that device thread, which carries the graph task's ThreadLocalState (grad mode,
autocast, the Python dispatch modes: engine.cpp, `at::ThreadLocalStateGuard tls_guard(graph_task->thread_locals_)`)
but not Python thread-locals: not threadpar's rank context.

With the double every device is the CPU, so `device_threads()` patches torch.autograd's entry to the engine
(torch/autograd/graph.py, `_engine_run_backward`, which backward() and grad() call) to run the backward on a
worker thread of its own per calling rank thread, with the caller's grad mode and autocast state, while the
caller waits; errors are re-raised in the caller. A thread that turned autograd's multithreading off
(torch.autograd.set_multithreading_enabled(False), thread-local) runs its backward itself, as the engine does.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd

from . import sim_gpu
from .fake_device import active_touch
from .fake_device_index import all_current_streams, bound_to, fake_device_index

_PATCH_LOCK = threading.Lock()
_active = [0]  # how many device_threads() contexts are open (nested launches share one patch)
_original: list[Callable[..., Any]] = []


class _DeviceThread:
    """One worker standing for the device thread of one rank's GPU."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            del job

    def run(self, fn: Callable[[], Any]) -> Any:
        grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")
        gpu = fake_device_index()  # the device thread of the caller's GPU (fake_device_index.py)
        streams = all_current_streams()  # its ops run on the caller's streams (fake_device_index.py)
        touch = active_touch()  # the double's device watches its host ops too (fake_device.DeviceTouch)
        model = sim_gpu.bound()  # the caller's GPUs: its device ops are checked against their pending work
        done = threading.Event()
        outcome: list[Any] = [None, None]

        def job() -> None:
            try:
                # The graph task's thread-local state, as the engine restores it on its device threads.
                torch.set_grad_enabled(grad)
                torch.set_autocast_enabled("cpu", autocast)
                torch.set_autocast_dtype("cpu", dtype)
                previous = sim_gpu.bind(model)
                try:
                    with (
                        bound_to(gpu, streams),
                        touch.again() if touch is not None else contextlib.nullcontext(),
                    ):
                        outcome[0] = fn()
                finally:
                    sim_gpu.bind(previous)
            except BaseException as error:
                outcome[1] = error
            finally:
                done.set()

        self.jobs.put(job)
        done.wait()
        if outcome[1] is not None:
            raise outcome[1]
        return outcome[0]


_threads: dict[int, _DeviceThread] = {}
_local = threading.local()


def _on_device_thread(*args: Any, **kwargs: Any) -> Any:
    original = _original[0]
    if getattr(_local, "device_thread", False):  # already on one (a backward inside a backward)
        return original(*args, **kwargs)
    # engine.cpp, Engine::ready_queue: `if (multithreading_disabled || ...) return cpu_ready_queue;`, driven by
    # the calling thread
    if not torch._C._is_multithreading_enabled():
        return original(*args, **kwargs)
    caller = threading.get_ident()
    with _PATCH_LOCK:
        worker = _threads.get(caller)
        if worker is None:
            worker = _threads[caller] = _DeviceThread(f"autograd-device[{threading.current_thread().name}]")

    def backward() -> Any:
        _local.device_thread = True
        return original(*args, **kwargs)

    return worker.run(backward)


@contextlib.contextmanager
def device_threads() -> Iterator[None]:
    """While open, every backward runs on a device thread of its own per calling thread (see above)."""
    with _PATCH_LOCK:
        if _active[0] == 0:
            _original[:] = [torch.autograd._engine_run_backward]
            torch.autograd._engine_run_backward = _on_device_thread  # type: ignore[attr-defined]
        _active[0] += 1
    try:
        yield
    finally:
        workers: list[_DeviceThread] = []
        with _PATCH_LOCK:
            _active[0] -= 1
            if _active[0] == 0:
                torch.autograd._engine_run_backward = _original[0]  # type: ignore[attr-defined]
                workers = list(_threads.values())
                _threads.clear()
        for worker in workers:
            worker.jobs.put(None)
