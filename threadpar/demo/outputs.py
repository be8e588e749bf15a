"""After the ranks finish: the summary, the files in --out, the checkpoint, and the --check reference."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from threadpar.checkpoint import load_optimizer_state, save_atomic
from threadpar.demo.cli import DemoConfig
from threadpar.demo.report import format_bytes, write_loss_png, write_metrics, write_timeline_png
from threadpar.demo.train import AUTOCAST, RunState, make_optimizer
from threadpar.errors import ConfigError
from threadpar.models.gpt import GPT, GPTConfig
from threadpar.pipeline import measured_bubble, write_chrome_trace

CHECKPOINT_FILE = "checkpoint.pt"
CHECK_STEPS = 3


@dataclass
class Summary:
    text: str
    metrics: dict[str, Any]


def layout_sizes(cfg: DemoConfig) -> dict[str, int]:
    """The axis sizes (cp and ep only when used)."""
    sizes = {"dp": cfg.layout.dp, "cp": cfg.cp, "tp": cfg.layout.tp, "pp": cfg.layout.pp, "ep": cfg.ep}
    return {k: v for k, v in sizes.items() if k not in ("cp", "ep") or v > 1}


def layout_text(cfg: DemoConfig) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in layout_sizes(cfg).items() if axis != "ep") + (
        f" (experts over ep={cfg.ep})" if cfg.ep > 1 else ""
    )


def _pipeline_zero(run: RunState) -> list:
    """The timelines of the pipeline that rank 0 belongs to (one per stage)."""
    return [run.timelines[r] for r in run.config.layout.group_ranks("PP", 0) if r in run.timelines]


def reference_losses(run: RunState) -> dict[str, Any]:
    """Re-run the first steps on one thread with the plain GPT and compare the losses. Each step runs one
    forward per (DP replica, microbatch), as the parallel run does: a MoE routes per forward."""
    cfg = run.config
    assert cfg.microbatches is not None  # DemoConfig.__post_init__ derived it
    steps = range(run.start_step, min(cfg.steps, run.start_step + CHECK_STEPS))
    model = GPT(run.gpt, autocast_dtype=AUTOCAST[cfg.dtype])
    model.load_state_dict(run.dense_state)
    optimizer = make_optimizer(model.parameters(), cfg.lr)
    if run.optimizer_state is not None:
        load_optimizer_state(optimizer, [model], run.optimizer_state)
    reference, norms = [], []
    for step in steps:
        inputs, targets = run.batches.batch(step)
        loss = model.accumulate_gradients(inputs, targets, forwards=cfg.layout.dp * cfg.microbatches)
        if cfg.clip_grad > 0:  # torch's own clipping on the whole model: what the ranks' clip must equal
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.append(loss.item())
    parallel = run.losses[: len(reference)]
    diff = max(abs(a - b) for a, b in zip(parallel, reference))
    # Relative to the loss: the parallel run sums in another order, and from the second step on Adam turns
    # last-bit differences of near-zero gradients into lr-sized updates (measured: 2e-5 of the loss in fp32).
    tolerance = (1e-4 if cfg.dtype == "fp32" else 5e-2) * max(1.0, max(abs(r) for r in reference))
    return {
        "steps": len(reference),
        "parallel": parallel,
        "reference": reference,
        "max_abs_diff": diff,
        "ok": diff <= tolerance,
        "grad_norms": {"parallel": run.grad_norms[: len(norms)], "reference": norms} if norms else None,
    }


def summarize(run: RunState, wall_seconds: float, check: dict[str, Any] | None) -> Summary:
    cfg, layout = run.config, run.config.layout
    timed = run.step_seconds[1:] or run.step_seconds  # the first step includes one-time setup
    tokens_per_s = run.tokens_per_step / statistics.median(timed)
    pipeline = _pipeline_zero(run)
    bubble = measured_bubble(pipeline) if layout.pp > 1 and pipeline else 0.0
    peaks: dict[int, dict[str, Any]] = {
        r: {
            "saved_activations_bytes": run.activation_peaks.get(r, 0),
            "device_allocated_bytes": run.device_peaks.get(r),
        }
        for r in range(layout.world_size)
    }
    lines = [
        f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f} over steps {run.start_step + 1}..{cfg.steps}",
        f"throughput {tokens_per_s:,.0f} tokens/s (median step {statistics.median(timed) * 1e3:.1f} ms), wall {wall_seconds:.1f} s",
        f"pipeline bubble (measured, last step): {bubble:.1%}; waiting for messages "
        f"{sum(t.waiting_time() for t in pipeline) / len(pipeline) * 1e3:.1f} ms per stage"
        if layout.pp > 1
        else "pipeline bubble: none (pp=1)",
    ]
    if cfg.moe_experts:
        lines.append(
            f"MoE: {cfg.moe_experts} experts, top-{cfg.moe_top_k}, ep={cfg.ep}; aux loss (in the loss) "
            f"{run.aux_losses[0]:.4f} -> {run.aux_losses[-1]:.4f}"
        )
    lines.append(_grad_norm_line(run))
    if run.skipped_steps:
        lines.append(f"fp16: {run.skipped_steps} step(s) skipped on overflow (agreed across all ranks)")
    per_rank = ", ".join(f"r{r} {format_bytes(p['saved_activations_bytes'])}" for r, p in peaks.items())
    when = "" if cfg.moe_experts else " (first step; every step is alike)"
    lines.append(f"peak saved activations per rank{when}: {per_rank}")
    state = run.optimizer_state_bytes
    sharded = f"ZeRO-{cfg.zero}, sharded over DP" if cfg.zero else "AdamW, not sharded"
    lines.append(
        f"optimizer state per rank ({sharded}): "
        + ", ".join(f"r{r} {format_bytes(state[r])}" for r in sorted(state))
    )
    if any(p["device_allocated_bytes"] for p in peaks.values()):
        device = ", ".join(f"r{r} {format_bytes(p['device_allocated_bytes'])}" for r, p in peaks.items())
        lines.append(f"peak device memory per rank: {device}")
    if check is not None:
        verdict = "match" if check["ok"] else "DIFFER"
        lines.append(
            f"check vs single-thread model, first {check['steps']} steps: {verdict} "
            f"(max |loss diff| {check['max_abs_diff']:.2e})"
        )
    metrics = {
        "model": cfg.model,
        "layout": layout_sizes(cfg),
        "processes": cfg.processes,
        "moe": {
            "experts": cfg.moe_experts,
            "top_k": cfg.moe_top_k,
            "capacity_factor": cfg.moe_capacity_factor,
            "ep": cfg.ep,
        }
        if cfg.moe_experts
        else None,
        "schedule": cfg.schedule,
        "microbatches": cfg.microbatches,
        "dtype": cfg.dtype,
        "first_step": run.start_step,
        "losses": run.losses,
        "aux_losses": run.aux_losses if cfg.moe_experts else None,
        "step_seconds": run.step_seconds,
        "tokens_per_s": tokens_per_s,
        "bubble": bubble,
        "peak_memory": peaks,
        "zero": cfg.zero,
        "optimizer_state_bytes": {
            str(r): run.optimizer_state_bytes[r] for r in sorted(run.optimizer_state_bytes)
        },
        "skipped_steps": run.skipped_steps,
        "clip_grad": cfg.clip_grad,
        "grad_norms": run.grad_norms,  # the whole model's, before clipping; null: an fp16 step was skipped
        "check": check,
    }
    return Summary("\n".join(lines), metrics)


def _grad_norm_line(run: RunState) -> str:
    norms = [n for n in run.grad_norms if n is not None]
    if not norms:
        return "gradient norm: none (every step skipped)"
    clip = run.config.clip_grad
    clipped = sum(n > clip for n in norms) if clip > 0 else 0
    how = f"clipped to {clip:g} in {clipped} of {len(norms)} steps" if clip > 0 else "not clipped"
    return f"gradient norm {norms[0]:.3f} -> {norms[-1]:.3f} (whole model, all ranks; {how})"


def write_outputs(out: Path, run: RunState, summary: Summary) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    cfg = run.config
    written = [out / "metrics.json"]
    write_metrics(out / "metrics.json", summary.metrics)
    title = f"GPT {cfg.model}, {layout_text(cfg)}, {cfg.schedule}"
    if write_loss_png(run.losses, out / "loss.png", title=title):
        written.append(out / "loss.png")
    pipeline = _pipeline_zero(run)
    if pipeline and any(t.events for t in pipeline):
        write_chrome_trace(out / "trace.json", pipeline)
        written.append(out / "trace.json")
        if write_timeline_png(pipeline, out / "timeline.png", title=f"last step, {cfg.schedule}"):
            written.append(out / "timeline.png")
    notes = [f"wrote {', '.join(str(p) for p in written)}"]
    if not (out / "loss.png").exists():
        notes.append("(plots need matplotlib: pip install 'threadpar[demo]')")
    return notes


def save_checkpoint(directory: Path, run: RunState) -> Path:
    """Merge every stage's dense parts into one unsplit checkpoint (written atomically)."""
    cfg = run.config
    model, optimizer = {}, {}
    for stage in sorted(run.model_parts):
        model.update(run.model_parts[stage])
        optimizer.update(run.optimizer_parts[stage])
    state = {
        "format": "threadpar-gpt/1",
        "config": run.gpt.to_dict(),
        "model": model,
        "optimizer": optimizer,
        "loss_scaler": run.final_scaler_state,
        "step": cfg.steps,  # also the data position: batch(step) is a function of (seed, step)
        "rng": {"seed": cfg.seed},  # every random stream of the demo derives from (seed, step)
        "data": {
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len,
            "source": str(cfg.data or "synthetic"),
        },
        "layout": layout_sizes(cfg),
        "losses": run.losses,
    }
    return save_atomic(state, directory / CHECKPOINT_FILE)


def load_checkpoint(directory: Path, gpt: GPTConfig) -> dict[str, Any]:
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise ConfigError(f"--resume: no checkpoint at {path}; run once with --checkpoint {directory} first")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if _model_identity(ckpt.get("config")) != _model_identity(gpt.to_dict()):
        raise ConfigError(
            f"--resume: the checkpoint in {directory} is for the model {ckpt.get('config')}, not {gpt.to_dict()}; "
            "pass the --model and --seq-len it was written with (and its --moe-experts, --moe-top-k and "
            "--moe-capacity-factor)"
        )
    return ckpt


def _model_identity(config: dict | None) -> dict | None:
    """A model's config without how it computes: padding the experts' rows (--cuda-graphs) changes no result."""
    return None if config is None else {k: v for k, v in config.items() if k != "moe_pad_to_capacity"}
