"""threadpar binds the NCCL torch uses (issue 37 item 6): a library of another version is another copy of NCCL,
whose communicators and state are not torch's; it is refused, saying which and how to fix it."""

from __future__ import annotations

import ctypes
import os
import types

import pytest

from threadpar.comm.nccl.library import LIBRARY_VARIABLE, check_same_nccl_as_torch
from threadpar.comm.nccl.library_copies import check_one_nccl, defining_file, mapped_nccl_files
from threadpar.errors import ConfigError


def test_the_same_version_as_torchs_is_taken():
    check_same_nccl_as_torch((2, 27, 3), (2, 27, 3))
    check_same_nccl_as_torch((2, 27, 3), None)  # (a torch without NCCL: nothing to compare)


def test_another_version_is_refused_naming_both_and_the_fix(monkeypatch):
    monkeypatch.delenv(LIBRARY_VARIABLE, raising=False)
    with pytest.raises(
        ConfigError, match=r"loaded NCCL 2\.21\.5 .*uses NCCL 2\.27\.3.*set THREADPAR_NCCL_LIBRARY"
    ):
        check_same_nccl_as_torch((2, 21, 5), (2, 27, 3))
    monkeypatch.setenv(LIBRARY_VARIABLE, "/opt/nccl/lib/libnccl.so.2")
    with pytest.raises(ConfigError, match=r"THREADPAR_NCCL_LIBRARY='/opt/nccl.*unset THREADPAR_NCCL_LIBRARY"):
        check_same_nccl_as_torch((2, 21, 5), (2, 27, 3))


@pytest.mark.cuda
def test_on_a_gpu_threadpar_binds_torchs_own_nccl():
    import torch

    from threadpar.comm.nccl.library import nccl_library

    assert nccl_library().version()[:3] == tuple(torch.cuda.nccl.version()[:3])


# A /proc/self/maps excerpt (proc(5): address, perms, offset, dev, inode, pathname) with torch's libnccl.
TORCH_NCCL = "/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
MAPS = f"""\
7f10a0000000-7f10a2000000 r--p 00000000 08:01 1311 {TORCH_NCCL}
7f10a2000000-7f10a9000000 r-xp 02000000 08:01 1311 {TORCH_NCCL}
7f10b0000000-7f10b1000000 r-xp 00000000 08:01 2222 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so
7f10c0000000-7f10c0021000 rw-p 00000000 00:00 0
7f10d0000000-7f10d0100000 r-xp 00000000 08:01 3333 /usr/lib/x86_64-linux-gnu/libc.so.6
"""


def test_the_mapped_libnccl_files_are_read_from_the_process_maps():
    assert mapped_nccl_files(MAPS) == [TORCH_NCCL]  # (each file once; anonymous maps and other libraries not)
    system = (
        "7f10e0000000-7f10e1000000 r-xp 00000000 08:01 4444 /usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5\n"
    )
    assert mapped_nccl_files(MAPS + system) == [TORCH_NCCL, "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"]
    assert mapped_nccl_files("") == []


def test_a_second_libnccl_of_the_same_version_is_refused_naming_both_files():
    check_one_nccl(TORCH_NCCL, [TORCH_NCCL])  # torch's own copy: the one threadpar binds
    check_one_nccl(None, [TORCH_NCCL])  # (dladdr said nothing: nothing to compare)
    system = "/usr/lib/x86_64-linux-gnu/libnccl.so.2"
    with pytest.raises(ConfigError, match=rf"bound the NCCL in {system}, but .*also has {TORCH_NCCL} loaded"):
        check_one_nccl(system, [TORCH_NCCL, system])


def test_the_file_a_bound_function_comes_from_is_found_with_dladdr():
    libc = ctypes.CDLL(None)
    found = defining_file(libc.strlen)
    assert found is not None and "libc" in os.path.basename(found)


def test_nccl_library_refuses_a_copy_other_than_the_one_mapped_for_torch(monkeypatch, tmp_path):
    # nccl_library() binds the first library it loads, then compares it with what else is mapped: here a
    # stand-in binding (the double's NCCL, by version) whose file is not torch's.
    from threadpar.comm.nccl import library

    class StandIn:
        lib = types.SimpleNamespace(ncclGetVersion=object())

        def version(self):
            return (2, 27, 3)

    monkeypatch.setattr(library, "_library", [])
    monkeypatch.setattr(library, "NcclLibrary", StandIn)
    monkeypatch.setattr(library, "torch_nccl_version", lambda: (2, 27, 3))  # the same version: passes that
    monkeypatch.setattr(library, "defining_file", lambda fn: "/opt/other/libnccl.so.2")
    monkeypatch.setattr(library, "read_maps", lambda: MAPS)
    with pytest.raises(
        ConfigError, match=r"/opt/other/libnccl\.so\.2.*also has .*nvidia/nccl/lib/libnccl\.so\.2"
    ):
        library.nccl_library()
    monkeypatch.setattr(library, "defining_file", lambda fn: TORCH_NCCL)
    assert isinstance(library.nccl_library(), StandIn)  # torch's own file: bound
