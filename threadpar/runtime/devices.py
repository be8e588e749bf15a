"""Which devices the ranks run on and which backend connects them (decided once per launch)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Gpus:
    """The GPUs this process's launches place ranks on: CUDA's (torch.cuda and the NCCL library torch loaded),
    unless a stand-in is installed with `gpus_of` (the tests' CUDA/NCCL double: tests/fakes)."""

    device_type: str
    count: Callable[[], int]
    runtime: Any = None  # the CudaApi and NcclRuntime of these GPUs (comm/common/cuda_seam.py); None: CUDA's


CUDA = Gpus("cuda", lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0)
_gpus: list[Gpus] = [CUDA]  # the process's GPUs: the last installed; guarded by _gpus_lock
_gpus_lock = threading.Lock()


def process_gpus() -> Gpus:
    """The GPUs a launch places its ranks on now (read once per launch, when it places them)."""
    with _gpus_lock:
        return _gpus[-1]


@contextlib.contextmanager
def gpus_of(gpus: Gpus) -> Iterator[None]:
    """While open, launches in this process (threadpar.launch, the demo) run their GPU ranks on `gpus`: how
    the tests run the code a GPU runs on the CUDA/NCCL double. Process-wide, as torch.cuda is."""
    with _gpus_lock:
        _gpus.append(gpus)
    try:
        yield
    finally:
        with _gpus_lock:
            _gpus.remove(gpus)


def cuda_device_count() -> int:
    return process_gpus().count()


def nccl_built() -> bool:
    """Whether NCCL can run here: CUDA, and a libnccl that loads (CUDA builds may lack it, e.g. some ROCm ones)."""
    runtime = process_gpus().runtime
    if runtime is not None:
        return bool(runtime.nccl_available())
    from threadpar.comm.nccl.cuda_api import nccl_runtime  # here: the nccl package loads only when asked

    return nccl_runtime().nccl_available()


# Why ranks sharing a GPU use the threads backend: NCCL refuses two ranks of one communicator on one device
# (src/init.cc: ncclInvalidUsage, "Duplicate GPU detected"). Autograd's shared per-device thread, the reason
# sharing was refused before (issue 14, defect 4), is off on such rank threads: runtime/autograd_threads.py.
NCCL_SHARED_GPU_REASON = (
    'NCCL refuses two ranks of one communicator on one GPU (ncclInvalidUsage, "Duplicate GPU detected", '
    "NCCL's src/init.cc)"
)


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
                if d.type not in ("cuda", process_gpus().device_type):
                    raise ConfigError(
                        f"devices lists CUDA devices; {d} is not one (use devices='cpu' for CPU threads)"
                    )
                d = d.index or 0
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ConfigError(f"device ids must be non-negative ints, got {d!r} in devices={devices!r}")
            ids.append(d)
        if not ids:
            raise ConfigError("devices is an empty list; pass at least one device id, an int, or 'cpu'")
        return ids  # a GPU named twice is shared by those ranks (resolve_placement)
    raise ConfigError(f"devices must be an int, a list of CUDA device ids, or 'cpu'; got {devices!r}")


def resolve_placement(
    world_size: int | None,
    devices: object,
    model_size: int,
    dp: int | None,
    backend: str,
    n_cuda: int | None = None,
    nccl: bool | None = None,
) -> Placement:
    """Decide world size, backend and each rank's device. `model_size` is tp * cp * pp.

    `n_cuda` is the number of visible CUDA devices and `nccl` whether this torch build has NCCL (both queried
    when None; tests pass them).
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
        named = ids is not None  # devices= named each rank's GPU (or the GPUs to share round-robin)
        if ids is None:
            ids = list(range(min(world_size, n_cuda)))
        missing = [i for i in ids if i >= n_cuda]
        if missing:
            raise ConfigError(f"devices={ids} asks for CUDA devices {missing}, but only {n_cuda} are visible")
        if len(ids) < world_size or len(set(ids)) < len(ids):
            return _shared_placement(world_size, ids, backend, named)
        if backend != "threads" and not (nccl_built() if nccl is None else nccl):
            if backend == "nccl":
                raise ConfigError(
                    f"backend='nccl': this torch build ({torch.__version__}) has no NCCL support; "
                    "use backend='threads' (or 'auto'), or install a torch built with NCCL"
                )
            fallback = (  # "auto" on a CUDA build without NCCL
                f"this torch build ({torch.__version__}) has no NCCL: {world_size} ranks on {world_size} "
                "GPU(s) use backend 'threads' (collectives through shared memory, not NCCL)"
            )
            return Placement(world_size, "threads", tuple(_gpu(i) for i in ids), fallback)
        devs = tuple(_gpu(i) for i in ids)
        return Placement(world_size, "threads" if backend == "threads" else "nccl", devs)

    if ids is not None and len(ids) != world_size:
        raise ConfigError(f"devices lists {len(ids)} devices but world_size={world_size}; make them agree")
    note = None
    if not cpu_requested:
        note = (
            f"no CUDA devices: running {world_size} ranks as CPU threads (backend 'threads', virtual devices)"
        )
    return Placement(world_size, "threads", tuple(torch.device("cpu") for _ in range(world_size)), note)


def _gpu(index: int) -> torch.device:
    return torch.device(process_gpus().device_type, index)


def _shared_placement(world_size: int, ids: list[int], backend: str, named: bool) -> Placement:
    """Several ranks on one GPU: rank r on ids[r % len(ids)] (round-robin; a list as long as the world names
    each rank's GPU itself), over the threads backend, which orders each cross-rank access with events on the
    ranks' own streams (comm/threads/stream_order.py). Each such rank thread runs its backward itself
    (runtime/autograd_threads.py)."""
    devices = tuple(_gpu(ids[r % len(ids)]) for r in range(world_size))
    gpus = len(set(ids))
    if backend == "nccl":
        raise ConfigError(
            f"backend='nccl' with {world_size} ranks on {gpus} GPU(s): {NCCL_SHARED_GPU_REASON}. Pass "
            "backend='threads' (or 'auto') to let ranks share GPUs, or give each rank its own GPU "
            f"(world_size={gpus})"
        )
    note = None
    if backend == "auto":
        how = "as devices= names them" if named and len(ids) == world_size else "round-robin"
        note = (
            f"{world_size} ranks share {gpus} GPU(s) ({how}) over backend 'threads', not nccl: "
            f"{NCCL_SHARED_GPU_REASON}"
        )
    return Placement(world_size, "threads", devices, note)
