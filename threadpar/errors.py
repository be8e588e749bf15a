"""threadpar's exceptions: one small hierarchy so callers can catch what they mean."""

from __future__ import annotations


class ThreadparError(Exception):
    """Base class of every error threadpar raises on purpose."""


class ConfigError(ThreadparError, ValueError):
    """Wrong user input (sizes, ranks, devices, options). The message says what was wrong and how to fix it."""


class NotInRankError(ThreadparError, RuntimeError):
    """A per-rank accessor was called outside a thread started by `threadpar.launch`."""


class CollectiveMismatchError(ThreadparError, RuntimeError):
    """The members of a group called different collectives (or shapes, dtypes) at the same point."""


class CollectiveTimeoutError(ThreadparError, TimeoutError):
    """A collective, receive or wait did not complete in time; the message names who did not arrive."""


class RankAborted(ThreadparError, RuntimeError):
    """Raised in a rank that was stopped because another rank failed or the caller was interrupted.

    It is a consequence, not a cause: `launch` reports the original failure instead.
    """

    def __init__(self, message: str = "stopped because the launch was aborted") -> None:
        super().__init__(message)


class RankFailedError(ThreadparError, RuntimeError):
    """A rank raised; carries that rank, its exception and its formatted traceback."""

    def __init__(self, rank: int, error: BaseException, traceback_text: str, others: list[int] | None = None):
        self.rank = rank
        self.error = error
        self.traceback_text = traceback_text
        self.other_failed_ranks = list(others or [])
        also = f" (ranks {self.other_failed_ranks} failed too)" if self.other_failed_ranks else ""
        super().__init__(
            f"rank {rank} failed with {type(error).__name__}: {error}{also}\n"
            f"--- traceback of rank {rank} ---\n{traceback_text.rstrip()}"
        )


class NcclError(ThreadparError, RuntimeError):
    """An NCCL call or an asynchronous NCCL error."""


class GraphCaptureError(ThreadparError, RuntimeError):
    """A step being captured as a CUDA graph does what a graph cannot hold (a host sync, a communicator's first
    use, point to point that waits on the host); the message names the op and the line."""


class RemoteRankError(ThreadparError, RuntimeError):
    """A rank (or the whole process) failed in another process of a multi-process job.

    Its message says which rank and process and what it raised; RankFailedError carries its traceback.
    """


class Terminated(SystemExit):
    """The process received SIGTERM while a launch ran: every rank (in every process) was stopped.

    A SystemExit whose code is 128 + the signal's number (143), the shell's convention for a process ended
    by that signal: uncaught, the process exits with it and without a traceback (the launch printed one
    line naming the signal). `signal_name` is "SIGTERM"."""

    def __init__(self, signum: int, signal_name: str) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal_name


def add_note(error: BaseException, text: str) -> None:
    """Attach `text` to an exception's report (Python 3.11+ notes; a no-op before)."""
    if hasattr(error, "add_note"):
        error.add_note(text)
