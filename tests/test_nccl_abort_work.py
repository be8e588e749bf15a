"""A Work whose communicator was aborted before its operation finished is not a success (issue 37 item 6):
ncclCommAbort ends the kernel, so its done event completes, and NCCL's error query on a freed communicator has
nothing to say (comm.py answers for it); the Work raises, naming the abort's cause."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar.errors import NcclError

pytestmark = pytest.mark.timeout(60)


def test_a_work_of_an_aborted_communicator_raises_naming_the_cause():
    seen: list = []
    issued = threading.Event()

    def body():
        t = torch.ones(4, device=threadpar.get_device())
        threadpar.all_reduce(t)  # (the communicators exist)
        if threadpar.get_rank() == 1:
            assert issued.wait(20)
            raise RuntimeError("rank 1 gives up")  # its part of the next all_reduce never comes
        work = threadpar.all_reduce(t, async_op=True)
        issued.set()
        deadline = time.monotonic() + 20
        while not work.is_completed() and time.monotonic() < deadline:  # (the stop aborts the communicators)
            time.sleep(0.005)
        seen.append(work.is_completed())
        seen.append(work.is_success())
        try:
            work.wait()
        except NcclError as error:
            seen.append(str(error))

    with pytest.raises(RuntimeError, match="rank 1 gives up"):
        run_fake_gpus(body, 2, FakeCuda(), timeout=5.0)
    assert seen[:2] == [True, False]
    assert len(seen) == 3 and "did not finish" in seen[2] and "was aborted: " in seen[2]
    assert "rank 1 failed with RuntimeError: rank 1 gives up" in seen[2]
