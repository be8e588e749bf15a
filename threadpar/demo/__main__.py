"""`python -m threadpar.demo --gpus 8`: train a small GPT with DP x TP x PP (and CP, MoE with EP) from one
process.

Without GPUs the ranks are CPU threads. The run prints the layout, a progress bar and a summary, and
writes a loss curve, a pipeline timeline (PNG and Chrome trace) and metrics.json to --out.

Under torchrun (`torchrun --nproc-per-node 2 -m threadpar.demo --gpus 2`) each process runs --gpus rank
threads, the layout spans all processes, and process 0 alone prints and writes (threadpar.demo.process_exchange).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import threadpar
from threadpar.demo import process_exchange
from threadpar.demo.cli import DemoConfig, parse_args
from threadpar.demo.data import Batches, load_tokens
from threadpar.demo.outputs import (
    layout_text,
    load_checkpoint,
    reference_losses,
    save_checkpoint,
    summarize,
    write_outputs,
)
from threadpar.demo.train import RunState, train_rank
from threadpar.errors import ConfigError
from threadpar.models.gpt import GPT, model_config
from threadpar.runtime.devices import cuda_device_count, resolve_placement
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv, default_local_devices


def placement(cfg: DemoConfig, env: ProcessEnv | None = None) -> tuple[str, str | None, str]:
    """(backend, devices, a line saying where the ranks run), as the library places them
    (threadpar.runtime.devices.resolve_placement): with fewer GPUs than --gpus, the ranks share the GPUs
    round-robin over the threads backend (NCCL needs one GPU per rank)."""
    n_cuda = cuda_device_count()
    if cfg.processes > 1:
        return _placement_across_processes(cfg, env or ProcessEnv(), n_cuda)
    devices = "cpu" if n_cuda == 0 else None  # "cpu": the line below says it, not the launch's note too
    placed = resolve_placement(cfg.gpus, devices, 1, None, "auto", n_cuda=n_cuda)
    if n_cuda == 0:
        return placed.backend, devices, f"no CUDA devices: running {cfg.gpus} ranks as CPU threads"
    if n_cuda < cfg.gpus:
        return (
            placed.backend,
            devices,
            f"{cfg.gpus} ranks on {n_cuda} GPU(s), sharing them round-robin over backend 'threads' (NCCL needs "
            f"one GPU per rank: pass --gpus {n_cuda} for NCCL)",
        )
    if placed.backend == "threads":  # a CUDA build of torch without NCCL (resolve_placement's fallback)
        return (
            placed.backend,
            devices,
            f"{cfg.gpus} ranks on {cfg.gpus} GPUs (no NCCL in this torch: threads)",
        )
    return placed.backend, devices, f"{cfg.gpus} ranks on {cfg.gpus} GPUs (NCCL)"


def _placement_across_processes(cfg: DemoConfig, env: ProcessEnv, n_cuda: int) -> tuple[str, str | None, str]:
    ranks = f"{cfg.processes} processes x {cfg.gpus} ranks = {cfg.world_size} ranks"
    if n_cuda == 0:
        return "threads", "cpu", f"no CUDA devices: {ranks}, as CPU threads"
    try:  # the GPUs launch would give this process's ranks: fail here, in the demo's words
        local = default_local_devices(n_cuda, cfg.gpus, env.local_rank, env.local_count)
    except ConfigError:
        raise ConfigError(
            f"{env.local_count} process(es) on this node with --gpus {cfg.gpus} each need "
            f"{env.local_count * cfg.gpus} GPUs, but this process sees {n_cuda}; pass a smaller --gpus or "
            "start fewer processes per node"
        ) from None
    # One GPU per rank: NCCL, also for the groups that span processes (threadpar.comm.nccl.spanning).
    placed = resolve_placement(cfg.gpus, local, 1, None, "auto", n_cuda=n_cuda)
    how = "NCCL, also between processes" if placed.backend == "nccl" else "no NCCL in this torch: threads"
    return placed.backend, None, f"{ranks} on {cfg.world_size} GPUs ({how})"


def launch_config(cfg: DemoConfig, backend: str, devices: str | None) -> LaunchConfig:
    """The launch options of a demo run: its layout over all processes, placed by `placement`."""
    return LaunchConfig(
        world_size=cfg.world_size,
        dp=cfg.layout.dp,
        cp=cfg.layout.cp,
        tp=cfg.layout.tp,
        pp=cfg.layout.pp,
        ep=cfg.ep if cfg.moe_experts else 1,
        backend=backend,
        devices=devices,
        seed=cfg.seed,
        print_layout=True,
        threads_per_process=cfg.gpus if cfg.processes > 1 else None,
        rank_cores=cfg.rank_cores,
    )


def prepare(cfg: DemoConfig) -> RunState:
    gpt = model_config(
        cfg.model, block_size=cfg.seq_len, moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
        moe_capacity_factor=cfg.moe_capacity_factor,
        # (graphed: every expert's rows padded to its capacity, fixed shapes; the same results)
        moe_pad_to_capacity=cfg.cuda_graphs and cfg.moe_capacity_factor is not None,
    )  # fmt: skip
    batches = Batches(load_tokens(cfg.data), cfg.batch_size, cfg.seq_len, cfg.seed)
    if cfg.resume:
        checkpoint = cfg.checkpoint
        assert checkpoint is not None  # DemoConfig: --resume needs --checkpoint
        if cfg.processes > 1:  # only process 0 needs to see the checkpoint directory
            ckpt = process_exchange.from_process_zero(lambda: load_checkpoint(checkpoint, gpt))
        else:
            ckpt = load_checkpoint(checkpoint, gpt)
        written = ckpt["data"]
        if (written["seed"], written["source"]) != (cfg.seed, str(cfg.data or "synthetic")):
            raise ConfigError(
                f"--resume: the checkpoint was trained on data {written['source']!r} with --seed {written['seed']}; "
                "pass the same --data and --seed to continue its data stream"
            )
        return RunState(
            config=cfg,
            gpt=gpt,
            batches=batches,
            dense_state=ckpt["model"],
            optimizer_state=ckpt["optimizer"],
            scaler_state=ckpt.get("loss_scaler"),
            start_step=ckpt["step"],
        )
    model = GPT(gpt).init_weights(torch.Generator().manual_seed(cfg.seed))
    return RunState(config=cfg, gpt=gpt, batches=batches, dense_state=model.state_dict())


def run_demo(cfg: DemoConfig, env: ProcessEnv | None = None) -> RunState:
    """Train; return this process's RunState (under torchrun, process 0's holds every rank's results)."""
    env = env or threadpar.process_env()
    if env.count != cfg.processes:
        raise ConfigError(f"the config is for {cfg.processes} process(es) but this job has {env.count}")
    backend, devices, where = placement(cfg, env)
    created_group = cfg.processes > 1 and process_exchange.connect(env, on_gpu=devices != "cpu")
    try:
        return _train_and_report(cfg, env, backend, devices, where)
    finally:
        # Before the interpreter exits: a gloo group destroyed during finalization can abort the process
        # ("terminate called without an active exception"), also after an error such as a bad --steps.
        if created_group:
            process_exchange.disconnect()


def _train_and_report(
    cfg: DemoConfig, env: ProcessEnv, backend: str, devices: str | None, where: str
) -> RunState:
    run = prepare(cfg)
    if run.start_step >= cfg.steps:
        raise ConfigError(
            f"the checkpoint is at step {run.start_step}; pass --steps larger than that to continue"
        )
    main_process = env.rank == 0
    params = sum(t.numel() for t in run.dense_state.values())
    if main_process:
        print(
            f"threadpar demo: GPT '{cfg.model}' ({params / 1e6:.2f}M parameters), {where}\n"
            f"layout {layout_text(cfg)}, schedule {cfg.schedule}, {cfg.microbatches} microbatches, "
            f"batch {cfg.batch_size} x {cfg.seq_len} tokens, {cfg.dtype}"
            + (", sequence parallel" if cfg.sequence_parallel else "")
            + (f", MoE {cfg.moe_experts} experts (top-{cfg.moe_top_k})" if cfg.moe_experts else "")
            + (", recompute" if cfg.recompute else "")
            + (f", ZeRO-{cfg.zero}" if cfg.zero else "")
            + (f", blocks compiled ({cfg.compile})" if cfg.compile else "")
            + (", CUDA graphs" if cfg.cuda_graphs else "")
            + (f", resuming at step {run.start_step}" if run.start_step else ""),
            flush=True,
        )
    if cfg.compile is not None:
        # Loaded before the launch, so that it raises dynamo's recompile limits for the rank threads, which
        # compile the blocks (threadpar.runtime.compiling).
        import torch._dynamo  # noqa: F401
    start = time.perf_counter()
    threadpar.launch(train_rank, run, config=launch_config(cfg, backend, devices))
    wall = time.perf_counter() - start
    if cfg.processes > 1:
        process_exchange.gather_to_process_zero(run)
        if not main_process:
            return run
    if cfg.checkpoint is not None:
        path = save_checkpoint(cfg.checkpoint, run)
        print(f"checkpoint: {path} (unsplit: loads into a plain GPT, resumes on any layout)")
    check = reference_losses(run) if cfg.check else None
    summary = summarize(run, wall, check)
    print(summary.text)
    if cfg.out is not None:
        for line in write_outputs(cfg.out, run, summary):
            print(line)
    return run


def main(argv: list[str] | None = None) -> int:
    where = "threadpar demo"
    try:
        env = threadpar.process_env()
        if env.count > 1:  # under torchrun every process reports its own errors: say which one
            where += f" (process {env.rank} of {env.count})"
        cfg = parse_args(argv, processes=env.count)
        run_demo(cfg, env)
    except ConfigError as error:
        print(f"{where}: {error}", file=sys.stderr)
        return 2
    return 0


def exit_now(code: int) -> None:
    """Under torchrun, leave without the interpreter's finalization. A gloo worker thread may still be
    releasing the tensors of the last collective (the results gathered to process 0), which needs the
    GIL; if the interpreter is finalizing by then, the thread's exit aborts the process ("terminate called
    without an active exception", torch#190489; seen in about a third of full-suite runs on 2 cores; core dump: gloo's runLoop
    in ~AsyncGatherWork -> pybind11 gil_scoped_acquire -> pthread_exit). Everything is written by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if threadpar.process_env().count > 1:
        exit_now(status)
    sys.exit(status)
