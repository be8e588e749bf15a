"""What one pipeline hop costs with small activations: a tensor, a tuple, a dict between stages.

    python -m benchmarks.pipeline_messages            # pp=2, n=8, activations [4, 16]
    python -m benchmarks.pipeline_messages --quick
    python -m benchmarks.pipeline_messages --kinds tensor   # the single-tensor path only
    python -m benchmarks.pipeline_messages --pp 1 --chunks 4  # one thread, messages to itself: no
                                                             # thread hand-offs, the steadiest figure

The chunks are tiny (an elementwise affine map and tanh), so a train step is almost all threadpar's own work: autograd
send/recv Functions, message packing, mailboxes, the action loop. The table gives the median step time and
that time divided by the number of hops the step makes (every microbatch crosses pp - 1 boundaries forward
and its gradient crosses them back), i.e. an upper bound on the cost of one message with its bookkeeping.

- tensor: each chunk passes one [rows, width] float tensor (the common case: the GPT and the demo);
- tuple:  (hidden [rows, width] float, mask [rows, width] int64), taken as two arguments;
- dict:   {"hidden": ..., "mask": ..., "scale": 0.5}, taken as keyword arguments.
With large activations (--rows 64 --width 16384: 4 MiB) the copies show: a structure is copied into its
packed message, and the backend then copies that message, as it copies a plain activation.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import threadpar
from benchmarks.harness import fmt_time, machine_line, median_time, table
from threadpar.pipeline import PipelineParallel


class Block(nn.Module):
    """A linear layer that takes and returns the activation in the form named by `kind`."""

    def __init__(self, kind: str, first: bool, width: int) -> None:
        super().__init__()
        self.kind, self.first = kind, first
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def forward(self, hidden, mask=None, scale=1.0):
        if self.first:  # chunk 0 gets the raw input [rows, width] and makes the mask
            mask = (hidden > 0).long()
        hidden = torch.tanh(hidden * self.weight + self.bias) * scale
        if self.kind == "tensor":
            return hidden
        if self.kind == "tuple":
            return hidden, mask
        return {"hidden": hidden, "mask": mask, "scale": 0.5}


def loss_fn(output, target):
    hidden = (
        output
        if isinstance(output, torch.Tensor)
        else (output[0] if isinstance(output, tuple) else output["hidden"])
    )
    return (hidden - target).square().mean()


def worker(kind: str, n: int, v: int, rows: int, width: int, iters: int, repeats: int) -> float:
    stage = threadpar.get_coords().pp
    torch.manual_seed(0)  # before any rank builds its chunks: the values do not matter here
    chunks = [Block(kind, first=stage == 0 and c == 0, width=width) for c in range(v)]
    schedule = "1f1b" if v == 1 else "interleaved"
    pipe = PipelineParallel(chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=n)
    inputs, targets = torch.randn(rows * n, width), torch.zeros(rows * n, width)
    group = threadpar.get_group("PP")
    for _ in range(3):
        pipe.train_step(inputs, targets)  # warm-up
    return median_time(
        lambda: pipe.train_step(inputs, targets), iters=iters, repeats=repeats, sync=group.barrier
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1, help="chunks per stage (> 1: interleaved)")
    parser.add_argument("--rows", type=int, default=4, help="rows of a microbatch's activation")
    parser.add_argument("--width", type=int, default=16, help="columns of a microbatch's activation")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kinds", default="tensor,tuple,dict")
    parser.add_argument("--quick", action="store_true", help="5 repeats of 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.repeats = 10, 5
    pp, n, v = args.pp, args.microbatches, args.chunks
    hops = 2 * n * (pp * v - 1)  # forward activations and gradients, over every chunk boundary
    print(f"# pipeline hops with small activations ({machine_line()})")
    print(
        f"# pp={pp}, n={n}, {v} chunk(s) per stage, activations [{args.rows}, {args.width}], median of {args.repeats} x {args.iters} steps\n"
    )
    rows = []
    for kind in args.kinds.split(","):
        step = threadpar.launch(
            worker,
            kind,
            n,
            v,
            args.rows,
            args.width,
            args.iters,
            args.repeats,
            world_size=pp,
            pp=pp,
            devices="cpu",
        )[0]
        rows.append([kind, fmt_time(step), fmt_time(step / hops)])
    print(table(["between stages", "step", "step / hops"], rows))


if __name__ == "__main__":
    main()
