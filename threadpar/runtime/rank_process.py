"""A process's state, per rank thread: what code written for one process per rank expects of its process.

While a launch runs, each rank thread sees torchrun's environment variables as that rank's
(`rank_environ`), seeds its own random generators (`rank_random`), and ends itself, not the program, with
`sys.exit` or `os._exit` (`rank_exit`), and records its own warnings in `warnings.catch_warnings`
(`rank_warnings`). `install`/`uninstall` are counted around a launch; `enter`/`leave`
bind one rank's state to its thread. What stays process-wide, and why: docs/process-per-rank-code.md.
"""

from __future__ import annotations

from threadpar.runtime import rank_environ, rank_exit, rank_random, rank_warnings
from threadpar.runtime.context import RankContext
from threadpar.runtime.process_env import local_place


def install() -> None:
    rank_environ.ROUTING.install()
    rank_random.ROUTING.install()
    rank_exit.ROUTING.install()
    rank_warnings.ROUTING.install()


def uninstall() -> None:
    rank_warnings.ROUTING.uninstall()
    rank_exit.ROUTING.uninstall()
    rank_random.ROUTING.uninstall()
    rank_environ.ROUTING.uninstall()


def torchrun_values(ctx: RankContext) -> dict[str, str]:
    """The variables torchrun would give this rank: across processes, the global rank and world size, and
    the rank's place among the rank threads of its node (its process's local rank x threads + its thread)."""
    world = ctx.world
    process = rank_environ.process_environ()
    threads = world.threads_per_process
    local_process, local_processes = local_place() if world.processes is not None else (0, 1)
    return rank_environ.torchrun_values(
        rank=ctx.rank,
        world_size=world.world_size,
        local_rank=local_process * threads + ctx.thread_rank,
        local_world_size=local_processes * threads,
        group_rank=int(process.get("GROUP_RANK", "0")) if world.processes is not None else 0,
        group_world_size=int(process.get("GROUP_WORLD_SIZE", "1")) if world.processes is not None else 1,
        process=process,
    )


def enter(ctx: RankContext) -> None:
    """Bind rank `ctx`'s process state to the calling thread (its rank thread)."""
    rank_environ.bind(torchrun_values(ctx))
    rank_random.bind(rank_random.RankRandom(ctx.device if ctx.device.type == "cuda" else None))
    rank_exit.bind(True)
    rank_warnings.bind(True)


def leave() -> None:
    rank_warnings.bind(False)
    rank_exit.bind(False)
    rank_random.bind(None)
    rank_environ.bind(None)
