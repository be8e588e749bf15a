"""`python -m threadpar.run`: torchrun's command line, its ranks as threads of this process.

The arguments are parsed by torchrun's own parser (`torch.distributed.run.get_args_parser`), so every torchrun
spelling works and anything else is argparse's error. One node (`--nnodes 1`, the default): `--nproc-per-node
N` rank threads in this process. Several nodes: torchrun starts one process per node, each of which runs
`python -m threadpar.run --nproc-per-node N` as its rank threads (torchrun x threads); run inside a torchrun
worker, threadpar.run does the same. Options that ask for what rank threads cannot do are refused, naming
them; options that only tune torchrun's process handling (start method, monitor interval, signals) mean
nothing for threads and are accepted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

# Option -> its default: refused when given another value (what it asks for has no thread equivalent).
REFUSED: dict[str, tuple[Any, str]] = {
    "max_restarts": (0, "rank threads are not restarted; a failure stops the run"),
    "no_python": (False, "the ranks run Python scripts or modules in this interpreter"),
    "logs_specs": (None, "torchrun's pluggable log layout is not supported; use --log-dir"),
    "numa_binding": (None, "rank threads share one process (see LaunchConfig.rank_cores)"),
    "duplicate_stdout_filters": ([], "not supported"),
    "duplicate_stderr_filters": ([], "not supported"),
    "event_log_handler": ("null", "not supported"),
    "virtual_local_rank": (False, "every rank thread sees its own LOCAL_RANK"),
}
OUTPUT_OPTIONS = ("--tee", "-t", "--redirects", "-r", "--log-dir", "--log_dir", "--local-ranks-filter",
                  "--local_ranks_filter")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser()
    parsed.prog = "python -m threadpar.run"
    parsed.description = "torchrun's command line, each rank a thread of this process (threadpar)."
    return parsed


def parse(argv: Sequence[str]) -> argparse.Namespace:
    args = parser().parse_args(list(argv))
    refused = [
        f"--{name.replace('_', '-')}"
        for name, (default, _) in REFUSED.items()
        if getattr(args, name) != default
    ]
    if refused:
        reasons = "; ".join(
            f"--{name.replace('_', '-')}: {why}"
            for name, (default, why) in REFUSED.items()
            if getattr(args, name) != default
        )
        raise SystemExit(
            f"python -m threadpar.run: {', '.join(refused)} not supported by rank threads ({reasons})"
        )
    return args


def nodes(args: argparse.Namespace) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    low, high = parse_min_max_nnodes(args.nnodes)
    if low != high:
        raise SystemExit(
            f"python -m threadpar.run: --nnodes {args.nnodes}: elastic node counts are not supported; give one number"
        )
    return int(low)


def nproc(args: argparse.Namespace) -> int:
    from torch.distributed.run import determine_local_world_size

    return int(determine_local_world_size(args.nproc_per_node))


def torchrun_command(argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The command that starts one process per node with torchrun, each running this node's rank threads:
    torchrun's options (but --nproc-per-node, which becomes 1, and the output options, which the node's
    threadpar.run applies per thread) then `-m threadpar.run --nproc-per-node N <output options> script`."""
    script_at = len(argv) - len(args.training_script_args) - 1
    options, tail = list(argv[:script_at]), list(argv[script_at:])
    outer: list[str] = []
    inner = ["--nproc-per-node", str(nproc(args))]
    i = 0
    while i < len(options):
        token = options[i]
        name, has_value, _ = token.partition("=")
        takes_value = name not in ("--standalone", "-m", "--module", "--run-path", "--run_path")
        if name in ("--nproc-per-node", "--nproc_per_node") or name in OUTPUT_OPTIONS:
            dest = inner if name in OUTPUT_OPTIONS else None
            value = [token] if has_value else options[i : i + 2]
            if dest is not None:
                dest.extend(value)
            i += 1 if has_value else 2
            continue
        if name in ("-m", "--module"):
            inner.append(token)
            i += 1
            continue
        outer.append(token)
        if not has_value and takes_value and token.startswith("-") and i + 1 < len(options):
            outer.append(options[i + 1])
            i += 1
        i += 1
    return [sys.executable, "-m", "torch.distributed.run", *outer, "--nproc-per-node", "1",
            "-m", "threadpar.run", *inner, *tail]  # fmt: skip


def output_options(args: argparse.Namespace, count: int) -> Any:
    """threadpar.run.Output from --tee, --redirects, --local-ranks-filter, --log-dir (torchrun's meanings)."""
    from torch.distributed.elastic.multiprocessing import Std

    from threadpar.run import Output

    def per_rank(value: str) -> dict[int, set[str]]:
        std = Std.from_str(value)
        table = std if isinstance(std, dict) else dict.fromkeys(range(count), std)
        return {
            rank: {n for n, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)) if s & bit}
            for rank, s in table.items()
        }

    tee, redirects = per_rank(args.tee), per_rank(args.redirects)
    local = (
        frozenset(int(r) for r in args.local_ranks_filter.split(",") if r.strip())
        if args.local_ranks_filter
        else None
    )
    log_dir = None
    if args.log_dir:
        log_dir = os.path.join(args.log_dir, f"{args.rdzv_id}_threadpar")
    return Output(tee=tee, redirects=redirects, local_ranks=local, log_dir=log_dir, role=args.role)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    from threadpar.errors import RankFailedError
    from threadpar.run import run
    from threadpar.runtime.process_env import process_env

    count = nproc(args)
    if nodes(args) > 1 and process_env().count == 1:
        command = torchrun_command(argv, args)
        os.execv(command[0], command)
    os.environ.setdefault("MASTER_ADDR", args.master_addr)
    os.environ.setdefault("MASTER_PORT", str(args.master_port or 29500))
    os.environ.setdefault("TORCHELASTIC_RUN_ID", args.rdzv_id)
    try:
        run(
            args.training_script,
            args.training_script_args,
            count,
            module=args.module,
            output=output_options(args, count),
        )
    except RankFailedError as failed:
        print(f"python -m threadpar.run: {failed}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
