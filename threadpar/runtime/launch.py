"""`launch`: run a function on one thread per rank and collect what each returns.

Failure handling: the first rank to raise triggers the launch's stop signal, which wakes every waiting
rank at once (they raise RankAborted, a consequence that is not reported as a cause). A rank busy in
Python code that does not reach a wait within a grace period gets RankAborted injected asynchronously.
`launch` then raises RankFailedError naming the failing rank, with its traceback, chained to its exception.
Ctrl-C in the calling thread stops every rank the same way and re-raises KeyboardInterrupt; SIGTERM
stops them the same way and exits with code 143 (threadpar.runtime.signals). Either prints one line naming
the signal.

Under torchrun (`threads_per_process=T`) each process runs the threads of its own T ranks; a failure in any
process stops every process (threadpar.runtime.peer_processes), and each raises the same root cause.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from threadpar.comm.common.gpu import is_gpu
from threadpar.errors import ConfigError, RankAborted, RankFailedError, RemoteRankError, Terminated
from threadpar.runtime import rank_process
from threadpar.runtime.autograd_threads import backward_on_this_thread, shares_gpu
from threadpar.runtime.compiling import rank_thread_contexts
from threadpar.runtime.context import RankContext, leave
from threadpar.runtime.devices import cuda_device_count, process_gpus, resolve_placement, say_once
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.peer_processes import Processes
from threadpar.runtime.process_env import ProcessEnv, bootstrap_store, default_local_devices, process_env
from threadpar.runtime.rank_cores import allowed_cpus, choose_rank_cpus, current_cpu
from threadpar.runtime.rank_exit import ProcessExit, end_of_rank
from threadpar.runtime.signals import Signalled, sigterm_raises
from threadpar.runtime.torch_world import LaunchTorchWorld
from threadpar.runtime.world import World
from threadpar.topology import Layout

if TYPE_CHECKING:
    from threadpar.torch_dist.session import TorchDistSession

CHECK_COLLECTIVES_VAR = "THREADPAR_CHECK_COLLECTIVES"
# After a failure, how long ranks get to notice the stop signal before one is injected, and then to exit.
ABORT_GRACE_S = 0.75
INJECT_GRACE_S = 0.5


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_intraop_threads(world_size: int, on_cpu: bool) -> int:
    """Divide the cores among the rank threads on CPU; on GPUs ranks need little CPU parallelism."""
    return (
        max(1, available_cores() // world_size) if on_cpu else max(1, min(4, available_cores() // world_size))
    )


@dataclass
class _Failure:
    rank: int
    error: BaseException
    traceback_text: str
    when: float


class _InjectedAbort(RankAborted):
    def __init__(self) -> None:
        super().__init__("stopped: the launch was aborted while this rank was running")


def _inject(thread: threading.Thread) -> None:
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_InjectedAbort)
        )


class _Launch:
    """The rank threads of this process (all ranks, unless the launch spans processes)."""

    def __init__(self, world: World, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.world = world
        self.fn, self.args, self.kwargs = fn, args, kwargs
        ranks = world.local_ranks
        n = len(ranks)
        self.results: list[Any] = [None] * n  # indexed by thread rank (= global rank in one process)
        self.failures: list[_Failure] = []
        self.contexts = [RankContext(world, r) for r in ranks]
        self.torch_world = LaunchTorchWorld(world) if world.torch_distributed else None
        self.running = [False] * n  # inside the user's function: only then may an abort be injected
        self.left = [False] * n  # past its last step: only the thread's own teardown is left
        # Guards running, left, failures and finished (DESIGN.md rule 10); results[i] is written by rank i alone.
        self.lock = threading.Lock()
        self.finished = 0
        self.all_done = threading.Event()
        # Each rank runs in a copy of this thread's context, with dynamo's recompile limits raised (compiling).
        contexts = rank_thread_contexts(n)
        self.threads = [
            threading.Thread(
                target=contexts[i].run, args=(self._rank_main, i), name=f"threadpar-rank-{r}", daemon=True
            )
            for i, r in enumerate(ranks)
        ]
        world.failure_sink = self._reported
        if world.backend == "nccl":  # NCCL's settings, checked before any rank starts (bootstrap.py)
            world.nccl_runtime().prepare_environment()

    def _rank_main(self, i: int) -> None:
        # A rank sharing its GPU runs its backward itself, not on the device's one autograd thread, which
        # the other ranks' backward would wait behind (runtime/autograd_threads.py).
        world = self.world
        with backward_on_this_thread(shares_gpu(world.devices, world.local_ranks, world.local_ranks[i])):
            self._rank_body(i)

    def _rank_body(self, i: int) -> None:
        ctx = self.contexts[i]
        session: TorchDistSession | None = None
        try:
            ctx.enter()
            rank_process.enter(ctx)  # torchrun's variables, its own seeds, sys.exit ends the rank
            if self.torch_world is not None:
                session = self.torch_world.session(ctx.rank)
                session.start()
                # The rank's intra-op thread count again, right before its function (DESIGN.md rule 4):
                # without it, simulated processes with different intraop_threads saw each other's count
                # in 4 runs of 6 once the session start (c10d's group construction) ran after enter().
                torch.set_num_threads(self.world.intraop_threads)
            with self.lock:
                self.running[i] = True
            try:
                self.results[i] = self.fn(*self.args, **self.kwargs)  # read after all_done: ordered by it
            except (SystemExit, ProcessExit) as exited:
                # As a process's exit: code 0 ends the rank (its result None), any other fails it.
                end_of_rank(exited, ctx.rank)
            finally:
                with self.lock:
                    self.running[i] = False
            if session is not None:
                ending: TorchDistSession = session
                session = None  # ended here: the failure path below must not end it again
                ending.end()
        except BaseException as error:
            self._record(ctx.rank, error)
        finally:
            if session is not None:
                session.end_quietly()  # after a failure: never masks the error being reported
            rank_process.leave()
            leave()
            with self.lock:
                self.left[i] = True
                self.finished += 1
                if self.finished == len(self.threads):
                    self.all_done.set()

    def _record(self, rank: int, error: BaseException, text: str | None = None) -> None:
        consequence = isinstance(error, RankAborted) and self.world.abort.is_set
        if not consequence:
            text = traceback.format_exc() if text is None else text
            with self.lock:
                self.failures.append(_Failure(rank, error, text, time.monotonic()))
            if self.world.processes is not None:
                self.world.processes.publish_rank_failure(rank, error, text)
            self.world.abort.trigger(f"rank {rank} failed with {type(error).__name__}: {error}")

    def _reported(self, rank: int, error: BaseException) -> None:
        """A rank's failure found by another thread (the nccl watchdog: an asynchronous NCCL error, a call a
        peer never issued): recorded as if the rank had raised it, with where the rank's thread was then."""
        thread = self.threads[rank - self.world.local_ranks[0]]
        frame = sys._current_frames().get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "  (not running)\n"
        text = (
            f"{type(error).__name__}: {error}\n(found by threadpar's NCCL watchdog while rank {rank}'s thread was "
            f"at:)\n{stack}"
        )
        self._record(rank, error, text)

    def run(self) -> list[Any]:
        try:
            with sigterm_raises():
                return self._run()
        except Signalled as signalled:
            self._say_stopped(signalled.name)
            raise Terminated(signalled.signum, signalled.name) from None
        except KeyboardInterrupt:
            self._say_stopped("SIGINT")
            raise

    def _say_stopped(self, signal_name: str) -> None:
        """One line on stderr: this process got a signal and stopped its ranks (and what failed first)."""
        world, processes = self.world, self.world.processes
        where = "" if processes is None else f"process {processes.rank} of {processes.count} "
        ranks = list(world.local_ranks)
        line = f"threadpar: {where}received {signal_name}; stopped its ranks {ranks[0]}-{ranks[-1]}"
        root = None if processes is None else processes.failure
        if root is not None and root.kind != signal_name:
            line += f" (the run had already failed: {root.describe().splitlines()[0]})"
        print(line, file=sys.stderr, flush=True)

    def _run(self) -> list[Any]:
        saved_threads = torch.get_num_threads()
        processes = self.world.processes
        rank_process.install()
        try:
            if self.torch_world is not None:
                self.torch_world.install()
            self._start_and_wait()
        except (Signalled, KeyboardInterrupt) as signalled:  # a signal while the ranks finish
            self._stop_everything("SIGINT" if isinstance(signalled, KeyboardInterrupt) else signalled.name)
            raise
        finally:
            self._join_left()
            failed = bool(self.failures) or self.world.abort.is_set
            closing: Exception | None = None
            try:
                self.world.close(failed)
            except Exception as problem:  # (raised below, once everything else is let go of too)
                closing = problem
            if self.torch_world is not None:
                self.torch_world.uninstall()
            rank_process.uninstall()
            for ctx in self.contexts:
                ctx.worker.stop()
            torch.set_num_threads(saved_threads)
            if processes is not None:
                processes.finish(failed=failed or closing is not None)
            if closing is not None and not failed:  # (after a failure, the failure is what the caller sees)
                raise closing
        root = None if processes is None else processes.failure
        if root is not None and (root.process != processes.rank or not self.failures):
            # The root cause is in another process (or is not a rank's exception): report it here too.
            if root.rank < 0:
                raise RemoteRankError(root.describe())
            failed_here = sorted({f.rank for f in self.failures})
            error = RemoteRankError(root.describe())
            raise RankFailedError(root.rank, error, root.traceback, failed_here) from error
        if self.failures:
            first = min(self.failures, key=lambda f: f.when)
            others = sorted({f.rank for f in self.failures if f is not first})
            raise RankFailedError(first.rank, first.error, first.traceback_text, others) from first.error
        return self.results

    def _start_and_wait(self) -> None:
        # Starting is inside the caller's try: a signal while the threads start stops those already running.
        for t in self.threads:
            t.start()
        while not self.all_done.wait(0.05):
            if self.world.abort.is_set:
                self._stop_stragglers()
                return

    def _join_left(self) -> None:
        """Wait for the teardown of every rank thread that left its function (not for one stuck in native
        code after a stop). A thread's teardown drops what it held (its function and arguments, its
        locals); left running, it may do so during interpreter exit, where a torch object whose destructor
        releases the GIL (a gloo group, a store) aborts the process ("terminate called without an active
        exception": pytorch/pytorch#38228, CPython gh-87135)."""
        with self.lock:
            left = [t for t, done in zip(self.threads, self.left) if done]
        for thread in left:
            thread.join()

    def _stop_everything(self, signal_name: str) -> None:
        """This process got a signal: stop every rank here and in the other processes."""
        if self.world.processes is not None:
            self.world.processes.signalled(signal_name)
        self.world.abort.trigger(f"{signal_name} in the calling thread")
        self._stop_stragglers()

    def _stop_stragglers(self) -> None:
        """After a stop: give ranks a moment to exit, inject an abort into those still running Python, and
        stop waiting for any stuck in native code (they are daemon threads and exit with their op)."""
        if self.all_done.wait(ABORT_GRACE_S):
            return
        with self.lock:  # (a rank cannot leave its function between the check and the injection's request)
            for rank, thread in enumerate(self.threads):
                if thread.is_alive() and self.running[rank]:
                    _inject(thread)
        self.all_done.wait(INJECT_GRACE_S)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    config: LaunchConfig | None = None,
    **options: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on one thread per rank; return the per-rank results indexed by thread
    rank (which is the global rank when all ranks are threads of this process).

    The launch options are LaunchConfig's fields, given as `config=LaunchConfig(...)`, as keywords
    (`launch(fn, world_size=8, tp=2)`), or both (the keywords replace the config's fields). `fn`'s own
    keyword arguments go in `kwargs={...}` (as torch.multiprocessing.spawn's `args`), never beside the
    options: a keyword that is not an option is a ConfigError, not an argument silently kept from `fn`.
    See LaunchConfig for what each option means.
    """
    if not callable(fn):
        raise ConfigError(f"launch needs a callable to run on each rank, got {type(fn).__name__}")
    config = resolve_config(config, options)
    return launch_in_process(process_env(), fn, args, _function_kwargs(kwargs), config)


def resolve_config(config: LaunchConfig | None, options: Mapping[str, Any]) -> LaunchConfig:
    """`config` (default: LaunchConfig()) with `options` replacing its fields; a ConfigError names an
    unknown option and says how to pass a function's keyword arguments."""
    if config is not None and not isinstance(config, LaunchConfig):
        raise ConfigError(
            f"config must be a threadpar.LaunchConfig, got {type(config).__name__}; build one with "
            "LaunchConfig(world_size=..., tp=...) or pass the options as keywords"
        )
    return (LaunchConfig() if config is None else config).with_options(options)


def _function_kwargs(kwargs: object) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(
            f"kwargs= holds the function's keyword arguments as a dict of name -> value, got {kwargs!r}"
        )
    return dict(kwargs)


def _threads_per_process(config: LaunchConfig, env: ProcessEnv) -> int | None:
    """The rank threads of each process: checked against the processes torchrun started."""
    threads = config.threads_per_process
    if threads is None:
        if env.count > 1:
            raise ConfigError(
                f"this is process {env.rank} of {env.count} (torchrun's environment), so say how many rank "
                "threads each process runs: launch(fn, threads_per_process=T) gives "
                f"{env.count} x T ranks"
            )
        return None
    if config.world_size is not None and config.world_size != env.count * threads:
        raise ConfigError(
            f"world_size={config.world_size} but {env.count} process(es) x threads_per_process={threads} = "
            f"{env.count * threads} ranks; leave world_size out, or make them agree"
        )
    return threads


def _rank_cores(
    config: LaunchConfig, on_cpu: bool, threads: int, local_index: int = 0, local_count: int = 1
) -> tuple[frozenset[int] | None, int]:
    """(the cores this process's rank threads run on, None: unpinned; the torch threads per rank)."""
    cpus = choose_rank_cpus(
        config.rank_cores,
        on_cpu=on_cpu,
        threads=threads,
        local_index=local_index,
        local_count=local_count,
        allowed=allowed_cpus(),
        current=current_cpu(),
    )
    if config.intraop_threads is not None:
        return cpus, config.intraop_threads
    if cpus is not None:  # the ranks share these cores: divide them, as the node's cores below
        return cpus, max(1, len(cpus) // threads)
    return cpus, default_intraop_threads(threads * local_count, on_cpu)


def launch_in_process(
    env: ProcessEnv, fn: Callable[..., Any], args: tuple, kwargs: dict, config: LaunchConfig
) -> list[Any]:
    """`launch` as process `env.rank` of `env.count` (threadpar.testing simulates processes with it)."""
    if not callable(fn):
        raise ConfigError(f"launch needs a callable to run on each rank, got {type(fn).__name__}")
    threads = _threads_per_process(config, env)
    if env.count == 1:
        world = _one_process_world(config, threads)
    else:
        assert threads is not None  # _threads_per_process requires it with several processes
        world = _multi_process_world(env, config, threads)
    if config.print_layout and env.rank == 0:
        print(world.layout.overview(), flush=True)
    return _Launch(world, fn, args, kwargs).run()


def _one_process_world(config: LaunchConfig, threads: int | None) -> World:
    """The World of a launch whose ranks are all threads of this process."""
    world_size = threads if threads is not None else config.world_size
    placement = resolve_placement(world_size, config.devices, config.model_size, config.dp, config.backend)
    layout = config.layout(placement.world_size)
    on_cpu = placement.devices[0].type == "cpu"
    if placement.note:
        say_once(placement.note)
    rank_cpus, intraop_threads = _rank_cores(config, on_cpu, placement.world_size)
    return World(
        layout=layout,
        backend=placement.backend,
        devices=placement.devices,
        timeout=config.timeout,
        seed=config.seed,
        intraop_threads=intraop_threads,
        cuda=None if on_cpu else process_gpus().runtime,
        torch_distributed=config.torch_distributed,
        rank_cpus=rank_cpus,
    )


def _multi_process_world(env: ProcessEnv, config: LaunchConfig, threads: int) -> World:
    """This process's World of a job of env.count processes x `threads` rank threads."""
    n_cuda = cuda_device_count()
    devices = config.devices
    if devices is None and n_cuda > 0:
        devices = default_local_devices(n_cuda, threads, env.local_rank, env.local_count)
    placement = resolve_placement(threads, devices, 1, None, config.backend, n_cuda=n_cuda)
    layout = config.layout(env.count * threads)
    on_cpu = placement.devices[0].type == "cpu"
    if env.rank == 0 and on_cpu:
        say_once(f"{env.count} processes x {threads} rank threads on CPU = {layout.world_size} ranks")
    if check_collectives_requested():
        config = dataclasses.replace(config, check_collectives=True)
    rank_cpus, intraop_threads = _rank_cores(config, on_cpu, threads, env.local_rank, env.local_count)
    return process_world(
        env,
        config,
        layout,
        placement.backend,
        placement.devices,
        intraop_threads,
        cuda=None if on_cpu else process_gpus().runtime,
        rank_cpus=rank_cpus,
    )


def check_collectives_requested() -> bool:
    """THREADPAR_CHECK_COLLECTIVES=1: LaunchConfig.check_collectives=True without editing the script (it only
    turns the check on); like TORCH_DISTRIBUTED_DEBUG, for finding a mismatch."""
    value = os.environ.get(CHECK_COLLECTIVES_VAR, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true"):
        raise ConfigError(f"{CHECK_COLLECTIVES_VAR}={value!r}: set it to 1 (check every call) or 0")
    return value in ("1", "true")


def process_world(
    env: ProcessEnv,
    config: LaunchConfig,
    layout: Layout,
    backend: str,
    devices: tuple[torch.device, ...],
    intraop_threads: int,
    *,
    cuda: Any = None,
    rank_cpus: frozenset[int] | None = None,
) -> World:
    """Meet the other processes and build this process's World of `config.threads_per_process` rank
    threads; `backend` and `devices` (this process's, one per thread) are where `config` placed them.
    `cuda` is the CudaApi (None: torch.cuda; tests pass the double)."""
    threads = config.threads_per_process
    if threads is None:
        raise ConfigError("a process of a multi-process job needs config.threads_per_process")
    store = bootstrap_store(env, is_gpu(devices[0]), config.timeout)
    processes = Processes(env, threads, store, config.timeout)
    processes.handshake(
        {
            "threads_per_process": threads,
            "layout": layout.describe(),
            "backend": backend,
            "seed": config.seed,
            "check_collectives": config.check_collectives,
        }
    )
    world = World(
        layout=layout,
        backend=backend,
        devices=tuple(devices[r % threads] for r in range(layout.world_size)),
        timeout=config.timeout,
        seed=config.seed,
        intraop_threads=intraop_threads,
        cuda=cuda,
        processes=processes,
        check_collectives=config.check_collectives,
        torch_distributed=config.torch_distributed,
        rank_cpus=rank_cpus,
    )
    processes.attach(world.abort, lambda rank: world.devices[rank])
    return world
