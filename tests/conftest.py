"""Test-suite wiring: tests marked `cuda` need real GPUs and are skipped, with the reason, on machines without."""

from __future__ import annotations

import pytest
import torch
from helpers.gpus import gpu_count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_count():
        return
    why = f"needs a CUDA GPU; this machine has none (torch {torch.__version__}); run `pytest -m cuda` on a GPU node"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
