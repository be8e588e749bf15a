"""What rank threads print, per rank: torchrun's `--tee` prefixes, `--local-ranks-filter` and `--log-dir` files.

torchrun shows a worker's tee'd lines prefixed with the role and local rank (`[default0]:`, torch/distributed/
elastic/multiprocessing/tail_log.py) and writes each worker's stdout and stderr to
`<log-dir>/<run id>_<suffix>/attempt_<n>/<local rank>/stdout.log` and `stderr.log`. While `routed_output`
is active, `sys.stdout` and `sys.stderr` are `RoutedStream`s: a thread with a `RankSink` bound writes through
it (whole lines, never interleaved with another rank's), every other thread to the original stream. Output
written by C code (printf) goes to the process's file descriptors unchanged.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

_local = threading.local()
_print_lock = threading.Lock()  # one line at a time on the console, from any rank


class RankSink:
    """One rank's stream: lines to the console (with a prefix, unless filtered out) and/or to a file."""

    def __init__(self, console: IO[str] | None, prefix: str, file: IO[str] | None) -> None:
        self.console, self.prefix, self.file = console, prefix, file
        self._partial = ""  # written by this rank's thread alone

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self._emit(lines)
        return len(text)

    def _emit(self, lines: list[str]) -> None:
        if self.file is not None:
            self.file.write("".join(f"{line}\n" for line in lines))
        if self.console is not None:
            with _print_lock:
                self.console.write("".join(f"{self.prefix}{line}\n" for line in lines))

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()
        if self.console is not None:
            self.console.flush()

    def close(self) -> None:
        if self._partial:
            self._emit([self._partial])
            self._partial = ""
        self.flush()
        if self.file is not None:
            self.file.close()


class RoutedStream(io.TextIOBase):
    """Stands in for sys.stdout or sys.stderr: the calling rank thread's sink, or the original stream."""

    def __init__(self, original: IO[str], name: str) -> None:
        self.original, self.name = original, name

    def _sink(self) -> Any:
        sink = getattr(_local, self.name, None)
        return self.original if sink is None else sink

    def write(self, text: str) -> int:
        return self._sink().write(text)

    def flush(self) -> None:
        self._sink().flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.original.fileno()

    def isatty(self) -> bool:
        return self.original.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.original, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:
        # buffer, errors, ...: the original stream's (bytes written to its buffer bypass the rank's sink).
        return getattr(self.original, name)


def bind(stdout: RankSink | None, stderr: RankSink | None) -> None:
    _local.stdout, _local.stderr = stdout, stderr


@contextlib.contextmanager
def routed_output() -> Iterator[None]:
    """sys.stdout and sys.stderr routed per rank thread while inside (the caller's thread: as before)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RoutedStream(saved[0], "stdout"), RoutedStream(saved[1], "stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def log_file(log_dir: str, local_rank: int, name: str) -> IO[str]:
    """`<log_dir>/attempt_0/<local_rank>/<name>.log`, as torchrun lays them out under its run's directory."""
    folder = os.path.join(log_dir, "attempt_0", str(local_rank))
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, f"{name}.log"), "w", encoding="utf-8")
