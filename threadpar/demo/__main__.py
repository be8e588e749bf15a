"""`python -m threadpar.demo --gpus 8`: train a small GPT with DP x TP x PP (and CP, MoE with EP) from one
process.

Without GPUs the ranks are CPU threads. The run prints the layout, a progress bar and a summary, and
writes a loss curve, a pipeline timeline (PNG and Chrome trace) and metrics.json to --out.
"""

from __future__ import annotations

import sys
import time

import torch

import threadpar
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
from threadpar.runtime.devices import cuda_device_count


def placement(cfg: DemoConfig) -> tuple[str, str | None, str]:
    """(backend, devices, a line saying where the ranks run)."""
    n_cuda = cuda_device_count()
    if n_cuda == 0:
        return "threads", "cpu", f"no CUDA devices: running {cfg.gpus} ranks as CPU threads"
    if n_cuda < cfg.gpus:
        return (
            "threads",
            None,
            f"{cfg.gpus} ranks but {n_cuda} GPU(s): ranks share GPUs on the 'threads' backend "
            f"(pass --gpus {n_cuda} to give each rank its own GPU with NCCL)",
        )
    return "nccl", None, f"{cfg.gpus} ranks on {cfg.gpus} GPUs (NCCL)"


def prepare(cfg: DemoConfig) -> RunState:
    gpt = model_config(
        cfg.model, block_size=cfg.seq_len, moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k
    )
    batches = Batches(load_tokens(cfg.data), cfg.batch_size, cfg.seq_len, cfg.seed)
    if cfg.resume:
        ckpt = load_checkpoint(cfg.checkpoint, gpt)
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


def run_demo(cfg: DemoConfig) -> RunState:
    backend, devices, where = placement(cfg)
    run = prepare(cfg)
    if run.start_step >= cfg.steps:
        raise ConfigError(
            f"the checkpoint is at step {run.start_step}; pass --steps larger than that to continue"
        )
    params = sum(t.numel() for t in run.dense_state.values())
    print(
        f"threadpar demo: GPT '{cfg.model}' ({params / 1e6:.2f}M parameters), {where}\n"
        f"layout {layout_text(cfg)}, schedule {cfg.schedule}, {cfg.microbatches} microbatches, "
        f"batch {cfg.batch_size} x {cfg.seq_len} tokens, {cfg.dtype}"
        + (", sequence parallel" if cfg.sequence_parallel else "")
        + (f", MoE {cfg.moe_experts} experts (top-{cfg.moe_top_k})" if cfg.moe_experts else "")
        + (", recompute" if cfg.recompute else "")
        + (f", resuming at step {run.start_step}" if run.start_step else ""),
        flush=True,
    )
    start = time.perf_counter()
    threadpar.launch(
        train_rank,
        run,
        world_size=cfg.gpus,
        dp=cfg.dp,
        cp=cfg.cp,
        tp=cfg.tp,
        pp=cfg.pp,
        backend=backend,
        devices=devices,
        seed=cfg.seed,
        print_layout=True,
    )
    wall = time.perf_counter() - start
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
    try:
        cfg = parse_args(argv)
        run_demo(cfg)
    except ConfigError as error:
        print(f"threadpar demo: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
