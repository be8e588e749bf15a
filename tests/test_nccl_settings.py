"""NCCL settings that make one process's rank threads wait for each other inside NCCL are refused when a launch
starts, before any rank runs, naming the reason and the fix (comm/nccl/bootstrap.py cites NCCL's source)."""

from __future__ import annotations

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("NCCL_LAUNCH_MODE", "GROUP", "host barrier of the process's rank threads"),
        ("NCCL_LAUNCH_MODE", "group", "host barrier"),
        ("NCCL_LAUNCH_ORDER_IMPLICIT", "1", "crossing point-to-point messages"),
        ("NCCL_SINGLE_PROC_MEM_REG_ENABLE", "1", "NVLS buffer registration"),
    ],
)
def test_a_setting_that_makes_rank_threads_wait_for_each_other_is_refused_at_launch(
    monkeypatch, name, value, why
):
    monkeypatch.setenv(name, value)
    started = []
    with pytest.raises(ConfigError, match=rf"{name}='{value}' .*{why}.*: unset it"):
        run_fake_gpus(lambda: started.append(threadpar.get_rank()), 2, FakeCuda())
    assert started == []  # (refused before any rank ran)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NCCL_LAUNCH_MODE", "PARALLEL"),
        ("NCCL_LAUNCH_ORDER_IMPLICIT", "0"),
        ("NCCL_SINGLE_PROC_MEM_REG_ENABLE", "0"),
    ],
)
def test_their_defaults_are_accepted(monkeypatch, name, value):
    monkeypatch.setenv(name, value)

    def body():
        t = torch.ones(2, device=threadpar.get_device())
        threadpar.all_reduce(t)
        return t.cpu()

    for t in run_fake_gpus(body, 2, FakeCuda()):
        torch.testing.assert_close(t, torch.full((2,), 2.0))


def test_the_threads_backend_does_not_ask(monkeypatch):
    monkeypatch.setenv("NCCL_LAUNCH_MODE", "GROUP")  # (no NCCL on CPU threads: nothing to refuse)
    assert threadpar.launch(threadpar.get_rank, world_size=2, devices="cpu") == [0, 1]
