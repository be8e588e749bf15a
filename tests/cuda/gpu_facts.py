"""The facts the CUDA/NCCL double models, observed on a real GPU in a process of their own (plain torch: no
double installed, so torch's accelerator is CUDA), for tests/cuda/test_double_rules_gpu.py.

`python tests/cuda/gpu_facts.py NAME...` runs each named fact and prints one JSON line per fact:
{"fact": NAME, "ok": true, ...what it observed} or {"fact": NAME, "ok": false, "error": "Type: message"}.
A fact that would hang prints {"fact": NAME, "started": true} first (its caller kills the process after a
while). Facts that need more GPUs than the machine has print {"fact": NAME, "skip": why}. A fact that breaks a
capture leaves the process's allocator capturing (aten/src/ATen/cuda/CUDAGraph.cpp, capture_end), so the caller
runs each of those in a process of its own. The facts are in gpu_facts_cuda.py (torch and CUDA) and
gpu_facts_nccl.py (NCCL through threadpar's binding)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second on a 2 GHz GPU
FACTS: dict[str, Callable[[], dict[str, Any]]] = {}


def fact(gpus: int = 1) -> Callable[[Callable[[], dict[str, Any]]], Callable[[], dict[str, Any]]]:
    def register(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            if torch.cuda.device_count() < gpus:
                return {"skip": f"needs {gpus} GPUs; this machine has {torch.cuda.device_count()}"}
            return fn()

        FACTS[fn.__name__] = run
        return fn

    return register


def error_of(fn: Callable[[], Any]) -> str | None:
    """What `fn` raised, as "Type: message" (with the message of what it raised during, if any), or None."""
    try:
        fn()
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if error.__context__ is not None:
            text += f" (during: {type(error.__context__).__name__}: {error.__context__})"
        return text
    return None


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main(names: list[str]) -> None:
    for name in names:
        try:
            record = {"fact": name, "ok": True, **FACTS[name]()}
        except Exception as error:
            record = {"fact": name, "ok": False, "error": f"{type(error).__name__}: {error}"}
        emit(record)
    os._exit(0)  # (no teardown: a fact may leave NCCL threads waiting for a peer that never comes)


if __name__ == "__main__":
    # (the fact modules import this module by name: they register in it, not in a second copy)
    sys.modules.setdefault("gpu_facts", sys.modules["__main__"])
    import gpu_facts_cuda  # noqa: F401  (registers its facts)
    import gpu_facts_nccl  # noqa: F401

    main(sys.argv[1:])
