"""SIGTERM stops a launch as Ctrl-C does.

torchrun forwards SIGTERM to its workers, and so do schedulers (Slurm, Kubernetes) and container runtimes
before they kill. Python's default for it kills the process at once: rank threads stop mid-step, other
processes learn of it only by a broken connection, and nothing says why. While a launch runs in the main
thread, SIGTERM instead raises `Signalled` there, as SIGINT raises KeyboardInterrupt; the launch stops
its ranks and tells the other processes, prints one line naming the signal, and raises
`threadpar.errors.Terminated`, a SystemExit with the conventional code 128 + 15 = 143 (what a shell
reports for a process killed by SIGTERM, and what torchrun shows as the worker's exit code).

A program with its own SIGTERM handler keeps it (threadpar installs its handler only over the default
action), and a second SIGTERM while the ranks stop has the default action: it kills at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Signalled(BaseException):
    """Raised in the main thread by the SIGTERM handler (a BaseException, as KeyboardInterrupt is)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"received {self.name}")


def _raise_signalled(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one kills at once
    raise Signalled(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside: SIGTERM raises Signalled in the main thread (where it has its default action)."""
    installed = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    )
    if installed:
        signal.signal(signal.SIGTERM, _raise_signalled)
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
