"""threadpar binds the NCCL torch uses (issue 37 item 6): a library of another version is another copy of NCCL,
whose communicators and state are not torch's; it is refused, saying which and how to fix it."""

from __future__ import annotations

import pytest

from threadpar.comm.nccl.library import LIBRARY_VARIABLE, check_same_nccl_as_torch
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
