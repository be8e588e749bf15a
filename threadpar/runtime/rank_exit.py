"""`sys.exit(code)` and `os._exit(code)` in a rank end that rank as a process exit would, not the program.

torchrun counts a worker that exits 0 as done and any other code as a failure of that worker
(torch/distributed/elastic/multiprocessing/api.py: a non-zero exit code is a `ProcessFailure`). In a rank
thread, `sys.exit(0)` (or `sys.exit()`, `sys.exit(None)`) ends the rank cleanly (its result is None); any
other code fails the rank with `RankExitError`, which names the rank and the code, and stops the launch as
any rank's failure does. `sys.exit("message")` is code 1, as Python's (the message is the error's text).

`os._exit` would end the whole process at once, every rank with it: while a launch runs, in a rank thread
it raises `ProcessExit` instead, a BaseException that neither `except Exception` nor `except SystemExit`
catches, so the rank ends with that code. Unlike a real `os._exit`, the rank's `finally` blocks and context
managers still run on the way out (a thread cannot be ended otherwise). Outside rank threads `os._exit` is
Python's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from threadpar.errors import ThreadparError


class RankExitError(ThreadparError, RuntimeError):
    """A rank called sys.exit or os._exit with a non-zero code (a failed worker, in torchrun's terms)."""

    def __init__(self, rank: int, code: int, how: str, message: str | None = None) -> None:
        self.rank, self.code = rank, code
        said = f": {message}" if message else ""
        super().__init__(f"rank {rank} exited with code {code} ({how}){said}")


class ProcessExit(BaseException):
    """Raised by os._exit(code) in a rank thread: unwinds the rank, which then ends with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def exit_code(ending: BaseException) -> tuple[int, str | None]:
    """(the exit code, a message) of a SystemExit or ProcessExit, as Python's interpreter maps them:
    None is 0, an int is itself, anything else is printed and is 1 (Python/pythonrun.c, handle_system_exit)."""
    code = ending.code if isinstance(ending, (SystemExit, ProcessExit)) else 1
    if code is None:
        return 0, None
    if isinstance(code, bool) or not isinstance(code, int):
        return (int(code), None) if isinstance(code, bool) else (1, str(code))
    return code, None


def end_of_rank(ending: BaseException, rank: int) -> None:
    """What a rank that raised SystemExit/ProcessExit returns: None for code 0; RankExitError otherwise."""
    code, message = exit_code(ending)
    if code != 0:
        how = "os._exit" if isinstance(ending, ProcessExit) else "sys.exit"
        raise RankExitError(rank, code, how, message) from None


_local = threading.local()


def bind(in_rank: bool) -> None:
    """Whether os._exit in the calling thread ends the rank (True) or the process."""
    _local.in_rank = in_rank


def _rank_os_exit(code: int) -> NoReturn:
    if getattr(_local, "in_rank", False):
        raise ProcessExit(code)
    _ORIGINAL["os._exit"](code)
    raise AssertionError("unreachable")  # (os._exit does not return)


_ORIGINAL: dict[str, Callable[..., Any]] = {}


class ExitRouting:
    """The counted installation of the rank-aware os._exit (one per process; `_lock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def install(self) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                _ORIGINAL["os._exit"] = os._exit
                os._exit = _rank_os_exit  # type: ignore[assignment]

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                os._exit = _ORIGINAL.pop("os._exit")


ROUTING = ExitRouting()
