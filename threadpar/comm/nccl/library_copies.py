"""Which file the NCCL threadpar bound is, and whether a second libnccl is mapped in the process.

library.check_same_nccl_as_torch compares versions: a copy of the same version in another file (a system
libnccl.so.2 next to the one in torch's wheel) passes it, yet is another NCCL, with its own bootstrap and
device state. On Linux the loader maps every shared library it opens, so two libnccl files in the process's
mappings (/proc/self/maps: proc(5)) are two NCCLs. Not seen: a torch built with NCCL linked statically
(USE_STATIC_NCCL) maps no libnccl of its own, so only the version comparison guards it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from typing import Any

from threadpar.errors import ConfigError

MAPS = "/proc/self/maps"
_NCCL_FILE = re.compile(r"(^|/)libnccl[^/]*\.so[^/]*$")


class _DlInfo(ctypes.Structure):  # Dl_info (dlfcn.h)
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def defining_file(function: Any) -> str | None:
    """The shared object a ctypes function was found in (dladdr, dlfcn.h), or None where dladdr says nothing."""
    with contextlib.suppress(AttributeError, OSError, TypeError, ValueError):
        libc = ctypes.CDLL(None)
        dladdr = libc.dladdr
        dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
        info = _DlInfo()
        address = ctypes.cast(function, ctypes.c_void_p).value  # (a ctypes function: its C address)
        if dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    return None


def mapped_nccl_files(maps: str) -> list[str]:
    """The libnccl files among the mappings of a /proc/<pid>/maps text (its last column: the path), each once."""
    files = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if _NCCL_FILE.search(path) and path not in files:
            files.append(path)
    return files


def read_maps() -> str:
    """This process's mappings ("" where there is no /proc: nothing to compare)."""
    try:
        with open(MAPS, encoding="utf-8", errors="replace") as maps:
            return maps.read()
    except OSError:
        return ""


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_one_nccl(bound: str | None, mapped: list[str]) -> None:
    """Refuse when a libnccl other than `bound` (the file threadpar's binding calls) is mapped: that one is
    torch's (or another library's), and two NCCLs in one process share no communicators or state."""
    others = [path for path in mapped if bound is None or not _same_file(path, bound)]
    if bound is None or not others:
        return
    raise ConfigError(
        f"threadpar bound the NCCL in {bound}, but this process also has {', '.join(others)} loaded (torch's "
        "own, or another library's): two NCCLs in one process do not share communicators or state. Set "
        f"THREADPAR_NCCL_LIBRARY to the path of the one torch loaded ({others[0]}, if that is torch's), or unset "
        "it so that threadpar binds the libnccl.so.2 torch already loaded"
    )
