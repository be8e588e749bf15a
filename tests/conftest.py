"""Test-suite wiring: tests marked `cuda` need real GPUs and are skipped, with the reason, on machines without."""

from __future__ import annotations

import pytest
import torch
from helpers.gpus import gpu_count


@pytest.fixture(autouse=True, scope="session")
def broken_torch_nccl_init_rank():
    """torch.cuda.nccl.init_rank as real torch has it on CPython 3.10-3.12 (pytorch#38019): it raises
    SystemError. threadpar must never reach it (its communicators come from NCCL's C API), so every test
    runs with it broken, whatever Python runs the suite."""
    import torch.cuda.nccl
    from fakes.fake_nccl import broken_torch_init_rank

    saved = torch.cuda.nccl.init_rank
    torch.cuda.nccl.init_rank = broken_torch_init_rank
    try:
        yield
    finally:
        torch.cuda.nccl.init_rank = saved


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_count():
        return
    why = f"needs a CUDA GPU; this machine has none (torch {torch.__version__}); run `pytest -m cuda` on a GPU node"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["eager", "lazy"])
def fake_mode(request: pytest.FixtureRequest):
    """Runs a test twice: its FakeCudas run each NCCL operation once every rank issued its part (eager), then
    only when something needs its result, reporting a buffer touched out of order as a race (lazy:
    tests/fakes/fake_device.py). Use with `pytestmark = pytest.mark.usefixtures("fake_mode")` in a module on
    the nccl path."""
    from fakes.fake_cuda_nccl import LAZY_DEFAULT

    LAZY_DEFAULT[0] = request.param == "lazy"
    try:
        yield request.param
    finally:
        LAZY_DEFAULT[0] = False


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """The double's tensors stand for CUDA ones: torch's capturable optimizers accept them (torch/optim/
    optimizer.py, _get_capturable_supported_devices, imported by name into torch/optim/adam.py)."""
    import importlib

    modules = [importlib.import_module(f"torch.optim.{name}") for name in ("optimizer", "adam")]
    devices = [*modules[0]._get_capturable_supported_devices(), "cpu"]
    for module in modules:
        monkeypatch.setattr(module, "_get_capturable_supported_devices", lambda supports_xla=True: devices)
