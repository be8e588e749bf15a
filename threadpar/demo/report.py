"""What the demo shows and writes: a progress bar, the summary, the loss curve and pipeline timeline PNGs,
and metrics.json. Plots need matplotlib (`pip install threadpar[demo]`); without it they are skipped with
a note, everything else still works.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO


class ProgressBar:
    """A one-line bar redrawn in place (step, loss, tokens/s) on a terminal or in a notebook; plain lines
    at every tenth of the run when the output is a file or a CI log."""

    def __init__(self, total: int, *, width: int = 24, stream: TextIO | None = None) -> None:
        self.total = total
        self.width = width
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.in_place = isatty() or "ipykernel" in sys.modules
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = int(self.width * step / max(1, self.total))
        bar = "#" * done + "." * (self.width - done)
        rate = f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f}"
        line = f"[{bar}] step {step}/{self.total}  loss {loss:.4f}  {rate} tok/s"
        if self.in_place:
            self.stream.write("\r" + line)
        elif step % self.every == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.in_place:
            self.stream.write("\n")
            self.stream.flush()


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_loss_png(losses: Sequence[float], path: Path, *, title: str) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(range(1, len(losses) + 1), losses, color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_timeline_png(timelines: Sequence[Any], path: Path, *, title: str) -> bool:
    """One row per pipeline stage (threadpar.pipeline.Timeline), forward, backward and W actions coloured."""
    plt = _pyplot()
    if plt is None:
        return False
    colors = {"forward": "#4c9be8", "backward": "#f28e2b", "weight": "#59a14f"}
    timelines = sorted(timelines, key=lambda t: t.stage)
    t0 = min(e.start for t in timelines for e in t.events)
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(timelines)), dpi=110)
    for row, timeline in enumerate(timelines):
        for e in timeline.events:
            left, width = (e.start - t0) * 1e3, e.duration * 1e3
            if e.category in colors:
                ax.barh(row, width, left=left, color=colors[e.category], edgecolor="white", linewidth=0.4)
                ax.text(left + width / 2, row, e.name, ha="center", va="center", fontsize=6)
            elif e.category == "recv":  # waiting for a neighbour, inside an action
                ax.barh(row, width, left=left, height=0.3, color="#888888", alpha=0.6)
    ax.set_yticks(range(len(timelines)), [f"stage {t.stage} (rank {t.rank})" for t in timelines])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(
        title + "  (blue: forward, orange: backward, green: weight gradients, grey: waiting for a message)"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_metrics(path: Path, metrics: dict[str, Any]) -> None:
    path.write_text(json.dumps(metrics, indent=2) + "\n")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
