"""`LaunchConfig`: every option of a launch in one frozen, validated object, passed through once."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from threadpar.errors import ConfigError
from threadpar.runtime.devices import BACKENDS
from threadpar.runtime.rank_cores import RankCores, check_rank_cores
from threadpar.topology import Axis, Layout, parse_order

DEFAULT_TIMEOUT_S = 300.0

# What a launch option may be given as: an int (that many devices), CUDA device ids, or "cpu".
Devices = int | str | Sequence[int | str | torch.device] | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str, value: object, meaning: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        leave_out = f" (or leave {name} out: {meaning})" if optional else f" ({name}=1: {meaning})"
        raise ConfigError(f"{name} must be a positive int, got {value!r}{leave_out}")


def _devices(devices: object) -> Devices:
    """The devices option in a frozen form (a list becomes a tuple); its shape is checked here, whether the
    devices exist when the launch places its ranks (threadpar.runtime.devices.resolve_placement)."""
    if devices is None or (_is_int(devices) and devices >= 1):  # type: ignore[operator]
        return devices  # type: ignore[return-value]
    if isinstance(devices, str) and devices.lower() == "cpu":
        return "cpu"
    if isinstance(devices, Sequence) and not isinstance(devices, str) and devices:
        return tuple(devices)
    raise ConfigError(
        f"devices must be an int (that many GPUs), a non-empty list of CUDA device ids, or 'cpu'; got {devices!r}"
    )


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to launch: the layout sizes, the devices and backend, and the run's timeout and seed.

    Every field is optional; `LaunchConfig()` runs one rank per visible GPU with NCCL. Invalid values raise
    ConfigError when the config is built, before any thread starts. What depends on the machine (how many
    GPUs are visible, how many processes torchrun started) is checked when the launch places its ranks.

    world_size: number of ranks (default: from devices, dp*tp*cp*pp, or the visible GPUs).
    devices: an int (that many devices), a list of CUDA device ids, or "cpu" (this process's devices).
    dp, tp, pp, cp: layout sizes; dp defaults to world_size / (tp * cp * pp).
    ep: expert parallelism, borrowed from DP x CP (it divides dp * cp): the MoE experts are split over runs
        of ep ranks of each DP x CP group (the "EP" groups); the ranks holding the same experts form the
        "EDP" groups (threadpar.topology).
    backend: "auto" (nccl with one GPU per rank; threads on CPU or with ranks sharing GPUs), "threads" or "nccl".
    timeout: seconds any collective or receive may wait before it fails, naming who did not arrive.
    seed: base seed of the per-rank generators (threadpar.get_generator()).
    order: axis order, outermost first (default "PP-DP-CP-TP": TP ranks adjacent).
    intraop_threads: torch threads per rank (default: the rank threads' cores divided among them on CPU).
    rank_cores: the CPU cores this process's rank threads share (threadpar.runtime.rank_cores): None (the
        default) packs CPU ranks onto one core when a process runs two or more (they share one GIL;
        spread over cores, each GIL hand-off becomes a cross-core wake-up) and leaves GPU ranks unpinned;
        "all" leaves them unpinned (CPU ranks doing heavy math); an int k gives them k cores.
    print_layout: print every rank's coordinates and groups before starting.
    threads_per_process: rank threads in each process of a job started by torchrun (or any launcher
        that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); world size = processes x this, and this
        process runs global ranks process_rank * T .. + T - 1. Required when there is more than one process.
    check_collectives: also check every NCCL collective between processes (a store round trip per call: a
        debugging aid, like TORCH_DISTRIBUTED_DEBUG). Without it the processes compare only each group's
        first NCCL collective; calls within a process, and calls gloo carries, are always checked. The
        environment variable THREADPAR_CHECK_COLLECTIVES=1 turns it on too, without editing the script.
    torch_distributed: initialise torch.distributed in every rank thread (a world of its own whose default
        group is the launch's world on the `threadpar` c10d backend), so torch's DDP, FSDP2, DTensor and
        pipelining run unchanged; False leaves torch.distributed uninitialised there.
    """

    world_size: int | None = None
    devices: Devices = None
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    backend: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S
    seed: int = 0
    order: str | Iterable[Axis | str] | None = None
    intraop_threads: int | None = None
    rank_cores: RankCores = None
    print_layout: bool = False
    threads_per_process: int | None = None
    check_collectives: bool = False
    torch_distributed: bool = True

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size, "derived from devices, dp*tp*cp*pp or the GPUs", True)
        object.__setattr__(self, "devices", _devices(self.devices))
        _positive("dp", self.dp, "world_size / (tp*cp*pp)", True)
        _positive("tp", self.tp, "no tensor parallelism")
        _positive("pp", self.pp, "no pipeline parallelism")
        _positive("cp", self.cp, "no context parallelism")
        _positive("ep", self.ep, "every expert on every rank")
        if self.dp is not None and (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide dp*cp = {self.dp}*{self.cp} = {self.dp * self.cp} (the experts are split "
                "over ep of the ranks that share a model shard); choose an ep that divides it"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.order is not None:
            parse_order(self.order)  # raises ConfigError naming the unknown or repeated axis
        _positive("intraop_threads", self.intraop_threads, "the cores divided among the ranks", True)
        check_rank_cores(self.rank_cores)
        if not isinstance(self.print_layout, bool):
            raise ConfigError(f"print_layout must be True or False, got {self.print_layout!r}")
        _positive("threads_per_process", self.threads_per_process, "one process", True)
        if not isinstance(self.check_collectives, bool):
            raise ConfigError(f"check_collectives must be True or False, got {self.check_collectives!r}")
        if not isinstance(self.torch_distributed, bool):
            raise ConfigError(f"torch_distributed must be True or False, got {self.torch_distributed!r}")
        if self.world_size is not None:
            self.layout(self.world_size)  # the sizes must fit the ranks: say so now, not at launch

    @property
    def model_size(self) -> int:
        """Ranks one model replica spans: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    def layout(self, world_size: int) -> Layout:
        """The layout of `world_size` ranks with these sizes and order (dp derived when not given)."""
        return Layout.build(
            world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, order=self.order, ep=self.ep
        )

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def with_options(self, options: Mapping[str, Any]) -> LaunchConfig:
        """This config with some fields replaced (validated again); an unknown name is a ConfigError."""
        unknown = [name for name in options if name not in self.option_names()]
        if unknown:
            raise ConfigError(unknown_options_message(unknown))
        return dataclasses.replace(self, **options) if options else self


def unknown_options_message(unknown: Sequence[str]) -> str:
    names = LaunchConfig.option_names()
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return (
        f"launch got unknown option(s) {', '.join(hints)}. The launch options are: {', '.join(names)}. "
        "Pass the function's own keyword arguments as kwargs={...}: launch(fn, *args, kwargs={'name': value})"
    )
