"""Run a script written for torchrun on rank threads: `python -m threadpar.run`, `threadpar.run_script`.

Each rank thread runs the script as `__main__` in a module of its own (its own globals, as each torchrun
worker has), with torchrun's environment variables, its own seeds and `sys.exit` ending the rank
(runtime/rank_process). `sys.argv` is the script's (the same for every rank, so it is set once for the
process), and the script's folder leads `sys.path`, as `python script.py` does. A module (`-m`) runs
through `runpy.run_module(..., alter_sys=False)`, which gives each call a fresh namespace.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from threadpar.errors import ConfigError
from threadpar.runtime import rank_output
from threadpar.runtime.launch import launch
from threadpar.runtime.process_env import process_env


@dataclass(frozen=True)
class Output:
    """torchrun's output options: streams tee'd to the console with `[<role><local rank>]:` (`--tee`),
    the others shown as they are, whole lines at a time (a worker process's own buffer keeps its lines whole;
    rank threads share sys.stdout, where print's text and its newline are two writes),
    streams only written to files (`--redirects`), the local ranks whose console output shows
    (`--local-ranks-filter`, None: all), and the folder of the per-rank log files (`--log-dir`)."""

    tee: dict[int, set[str]] = field(default_factory=dict)  # local rank -> {"stdout", "stderr"}
    redirects: dict[int, set[str]] = field(default_factory=dict)
    local_ranks: frozenset[int] | None = None
    log_dir: str | None = None
    role: str = "default"

    def sinks(self, local_rank: int) -> tuple[rank_output.RankSink | None, rank_output.RankSink | None]:
        sinks: list[rank_output.RankSink | None] = []
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            console = stream.original if isinstance(stream, rank_output.RoutedStream) else stream
            tee = name in self.tee.get(local_rank, set())
            redirected = tee or name in self.redirects.get(local_rank, set())
            shown = self.local_ranks is None or local_rank in self.local_ranks
            file = (
                rank_output.log_file(self.log_dir, local_rank, name) if self.log_dir and redirected else None
            )
            prefix = f"[{self.role}{local_rank}]:" if tee else ""
            sinks.append(
                rank_output.RankSink(console if shown and (tee or not redirected) else None, prefix, file)
            )
        return sinks[0], sinks[1]


@dataclass(frozen=True)
class _Script:
    """What each rank runs: a file's code, or a module by name."""

    path: str
    module: bool

    def code(self) -> types.CodeType | None:
        if self.module:
            return None
        with open(self.path, "rb") as source:
            return compile(source.read(), self.path, "exec")


def _run_in_rank(script: _Script, code: types.CodeType | None, output: Output) -> types.ModuleType:
    local_rank = int(os.environ["LOCAL_RANK"])
    stdout, stderr = output.sinks(local_rank)
    rank_output.bind(stdout, stderr)
    try:
        if code is None:
            namespace = runpy.run_module(script.path, run_name="__main__", alter_sys=False)
            module = types.ModuleType("__main__")
            module.__dict__.update(namespace)
            return module
        module = types.ModuleType("__main__")
        module.__dict__.update(__file__=script.path, __builtins__=builtins, __cached__=None, __spec__=None)
        exec(code, module.__dict__)
        return module
    finally:
        rank_output.bind(None, None)
        for sink in (stdout, stderr):
            if sink is not None:
                sink.close()


def run(
    script: str,
    argv: Sequence[str] = (),
    nproc: int | None = None,
    *,
    module: bool = False,
    output: Output | None = None,
    **options: Any,
) -> list[types.ModuleType]:
    """`run_script` with torchrun's output options (the command line's)."""
    target = _Script(script, module)
    if not module and not os.path.isfile(script):
        raise ConfigError(
            f"no such script: {script!r} (give a path to a .py file, or module=True for a module)"
        )
    code = target.code()
    env = process_env()
    if env.count > 1:  # a torchrun worker: its nproc ranks are threads of this process, torchrun x threads
        options.setdefault("threads_per_process", nproc if nproc is not None else 1)
    elif nproc is not None:
        options.setdefault("world_size", nproc)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)) if not module else os.getcwd())
    try:
        with rank_output.routed_output():
            return launch(_run_in_rank, target, code, Output() if output is None else output, **options)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def run_script(
    path: str, argv: Sequence[str] = (), nproc: int | None = None, *, module: bool = False, **options: Any
) -> list[types.ModuleType]:
    """Run a script written for torchrun (`torchrun --nproc-per-node nproc path argv...`) on `nproc` rank
    threads of this process; return each rank's module (its globals after the script ran), indexed by rank.

    `module=True` runs `path` as a module name (`torchrun -m`). `options` are threadpar.launch's
    (LaunchConfig's fields: devices, backend, timeout, ...). Inside a torchrun worker, the nproc ranks are
    that process's threads (threads_per_process). A rank that calls `sys.exit(0)` ends cleanly (its module
    is None); a non-zero exit or an exception stops every rank and raises RankFailedError naming it."""
    return run(path, argv, nproc, module=module, **options)
