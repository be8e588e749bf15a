"""The demo under torchrun: what process 0 needs from the other processes, through torch.distributed.

Each process runs --gpus rank threads and keeps its own `RunState`, so the results of ranks in other
processes (pipeline timelines, memory peaks, checkpoint parts) are not in process 0's memory, and only
process 0 prints and writes files. The processes therefore talk through torch.distributed's default group
(the one `threadpar.launch` bootstraps; object collectives run on its CPU backend, gloo):

- before training, process 0 reads the checkpoint to resume from and sends it to the others, so the
  checkpoint directory need only exist where process 0 runs;
- after training, process 0 gathers every other process's per-rank results into its own `RunState`.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from threadpar.demo.train import RunState
from threadpar.errors import ConfigError
from threadpar.pipeline import Timeline
from threadpar.runtime.launch_config import DEFAULT_TIMEOUT_S
from threadpar.runtime.process_env import ProcessEnv, bootstrap_store

# RunState fields keyed by global rank, each filled by the ranks of the process they run in. (The losses,
# step times and loss-scaler state come from rank 0, which always runs in process 0.)
PER_RANK_FIELDS = (
    "timelines",
    "activation_peaks",
    "device_peaks",
    "optimizer_state_bytes",
    "model_parts",
    "optimizer_parts",
)

T = TypeVar("T")


def connect(env: ProcessEnv, on_gpu: bool) -> bool:
    """Join the default group now (launch would later), so the processes can talk before training; True if
    this call created it (a script that calls the demo may have created it already)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    bootstrap_store(env, on_gpu, DEFAULT_TIMEOUT_S)
    return created


def disconnect() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def from_process_zero(load: Callable[[], T]) -> T:
    """`load()` run on process 0, its result in every process. If it raises, process 0 raises that and the
    others raise too (a ConfigError as such), instead of waiting for a result that will not come."""
    import torch.distributed as dist

    outcome: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            outcome = [("ok", load())]
        except ConfigError as error:
            failure, outcome = error, [("ConfigError", str(error))]
        except Exception as error:
            failure, outcome = error, [("error", f"process 0 failed with {type(error).__name__}: {error}")]
    dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    kind, value = outcome[0]
    if kind == "ConfigError":
        raise ConfigError(value)
    if kind == "error":
        raise RuntimeError(value)
    return value


def gather_to_process_zero(run: RunState) -> None:
    """Merge the other processes' per-rank results into process 0's `run` (a collective: every process)."""
    import torch.distributed as dist

    dist.barrier()
    # Read right after the barrier, so every process reads its clock at about the same moment: on another
    # machine, the difference is that machine's clock offset (to within a network round trip).
    clock = time.perf_counter()
    mine = {"host": socket.gethostname(), "clock": clock, **{f: getattr(run, f) for f in PER_RANK_FIELDS}}
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is not None:
        merge_parts(run, parts)


def merge_parts(run: RunState, parts: list[dict[str, Any]]) -> None:
    """Add the per-rank results of processes 1.. (`parts[1:]`) to process 0's `run` (`parts[0]` is its own).

    Timelines hold `time.perf_counter()` times. Processes on one machine share that clock (CLOCK_MONOTONIC);
    a process on another machine has its own, so its events move by the measured offset onto process 0's."""
    here = parts[0]
    for part in parts[1:]:
        offset = 0.0 if part["host"] == here["host"] else here["clock"] - part["clock"]
        for name in PER_RANK_FIELDS:
            values = part[name]
            if name == "timelines" and offset:
                values = {rank: shifted(timeline, offset) for rank, timeline in values.items()}
            getattr(run, name).update(values)


def shifted(timeline: Timeline, seconds: float) -> Timeline:
    moved = Timeline(timeline.rank, timeline.stage)
    moved.events = [
        dataclasses.replace(e, start=e.start + seconds, end=e.end + seconds) for e in timeline.events
    ]
    return moved
