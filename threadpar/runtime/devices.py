"""Which devices the ranks run on and which backend connects them (decided once per launch)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from threadpar.errors import ConfigError

BACKENDS = ("auto", "threads", "nccl")

_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(message: str) -> None:
    """Print a notice to stderr the first time it comes up in this process."""
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    print(f"threadpar: {message}", file=sys.stderr, flush=True)


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class Placement:
    world_size: int
    backend: str  # "threads" or "nccl"
    devices: tuple[torch.device, ...]  # one per global rank
    note: str | None = None  # what a user should be told once (e.g. running on CPU threads)


def _requested_ids(devices: object) -> list[int] | None:
    if isinstance(devices, bool):
        raise ConfigError(f"devices must be an int, a list of CUDA device ids, or 'cpu'; got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ConfigError(f"devices={devices} must be at least 1")
        return list(range(devices))
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        ids = []
        for d in devices:
            if isinstance(d, (torch.device, str)):
                d = torch.device(d)
                if d.type != "cuda":
                    raise ConfigError(
                        f"devices lists CUDA devices; {d} is not one (use devices='cpu' for CPU threads)"
                    )
                d = d.index or 0
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ConfigError(f"device ids must be non-negative ints, got {d!r} in devices={devices!r}")
            ids.append(d)
        if not ids:
            raise ConfigError("devices is an empty list; pass at least one device id, an int, or 'cpu'")
        if len(set(ids)) != len(ids):
            raise ConfigError(
                f"devices={ids} names a device twice; give each GPU once (backend='threads' shares GPUs)"
            )
        return ids
    raise ConfigError(f"devices must be an int, a list of CUDA device ids, or 'cpu'; got {devices!r}")


def resolve_placement(
    world_size: int | None,
    devices: object,
    model_size: int,
    dp: int | None,
    backend: str,
    n_cuda: int | None = None,
) -> Placement:
    """Decide world size, backend and each rank's device. `model_size` is tp * cp * pp.

    `n_cuda` is the number of visible CUDA devices (queried when None; tests pass it).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {BACKENDS}")
    if world_size is not None and (
        not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
    ):
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    n_cuda = cuda_device_count() if n_cuda is None else n_cuda
    cpu_requested = isinstance(devices, str) and devices.lower() == "cpu"
    if isinstance(devices, str) and not cpu_requested:
        raise ConfigError(f"devices={devices!r}: use an int, a list of CUDA device ids, or 'cpu'")
    ids = None if devices is None or cpu_requested else _requested_ids(devices)

    if world_size is None:
        if dp is not None:
            world_size = dp * model_size
        elif ids is not None:
            world_size = len(ids)
        elif n_cuda > 0 and not cpu_requested and backend != "threads":
            world_size = n_cuda
        else:
            raise ConfigError(
                "no CUDA devices here, so say how many rank threads to run: launch(fn, world_size=4) "
                "(or dp=/tp=/pp=, or devices=4)"
            )

    use_cuda = n_cuda > 0 and not cpu_requested
    if backend == "nccl" and not use_cuda:
        why = "devices='cpu' was requested" if cpu_requested else "no CUDA device is visible"
        raise ConfigError(
            f"backend='nccl' needs CUDA devices but {why}; use backend='threads' to run on CPU threads"
        )

    if ids is not None and len(ids) > world_size:
        raise ConfigError(f"devices lists {len(ids)} devices but world_size={world_size}; make them agree")
    if use_cuda:
        if ids is None:
            ids = list(range(min(world_size, n_cuda)))
        missing = [i for i in ids if i >= n_cuda]
        if missing:
            raise ConfigError(f"devices={ids} asks for CUDA devices {missing}, but only {n_cuda} are visible")
        if len(ids) == world_size and backend in ("auto", "nccl"):
            return Placement(world_size, "nccl", tuple(torch.device("cuda", i) for i in ids))
        if backend == "threads":
            # Several ranks may share a GPU: rank r runs on ids[r % len(ids)].
            devs = tuple(torch.device("cuda", ids[r % len(ids)]) for r in range(world_size))
            note = None
            if len(ids) < world_size:
                note = f"{world_size} ranks share {len(ids)} GPU(s) on the 'threads' backend (rank r on cuda:ids[r % {len(ids)}])"
            return Placement(world_size, "threads", devs, note)
        raise ConfigError(
            f"{world_size} ranks but only {len(ids)} GPU(s): NCCL needs one GPU per rank. Pass world_size={len(ids)} "
            f"(or fewer ranks), backend='threads' to let ranks share GPUs (to try TP/PP code on one GPU), "
            "or devices='cpu' to run on CPU threads"
        )

    if ids is not None and len(ids) != world_size:
        raise ConfigError(f"devices lists {len(ids)} devices but world_size={world_size}; make them agree")
    note = None
    if not cpu_requested:
        note = (
            f"no CUDA devices: running {world_size} ranks as CPU threads (backend 'threads', virtual devices)"
        )
    return Placement(world_size, "threads", tuple(torch.device("cpu") for _ in range(world_size)), note)
