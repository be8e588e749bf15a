"""What one pipeline hop costs with small activations: a tensor, a tuple, a dict between stages.

    python -m benchmarks.pipeline_messages            # pp=2, n=8, activations [4, 16]
    python -m benchmarks.pipeline_messages --quick
    python -m benchmarks.pipeline_messages --kinds tensor   # the single-tensor path only

The chunks are tiny (a 16x16 linear layer), so a train step is almost all threadpar's own work: autograd
send/recv Functions, message packing, mailboxes, the action loop. The table gives the median step time and
that time divided by the number of hops the step makes (every microbatch crosses pp - 1 boundaries forward
and its gradient crosses them back), i.e. an upper bound on the cost of one message with its bookkeeping.

- tensor: each chunk passes one [4, 16] float tensor (the common case: the GPT and the demo);
- tuple:  (hidden [4, 16] float, mask [4, 16] int64), the next chunk takes them as two arguments;
- dict:   {"hidden": [4, 16] float, "mask": [4, 16] int64, "scale": 0.5}, taken as keyword arguments.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import threadpar
from benchmarks.harness import fmt_time, machine_line, median_time, table
from threadpar.pipeline import PipelineParallel

WIDTH, ROWS = 16, 4


class Block(nn.Module):
    """A linear layer that takes and returns the activation in the form named by `kind`."""

    def __init__(self, kind: str, first: bool) -> None:
        super().__init__()
        self.kind, self.first = kind, first
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden, mask=None, scale=1.0):
        if self.first:  # chunk 0 gets the raw input [b, WIDTH] and makes the mask
            mask = (hidden > 0).long()
        hidden = torch.tanh(self.linear(hidden)) * scale
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


def worker(kind: str, n: int, iters: int, repeats: int) -> float:
    stage = threadpar.get_coords().pp
    torch.manual_seed(0)
    pipe = PipelineParallel(
        [Block(kind, first=stage == 0)], loss_fn=loss_fn, schedule="1f1b", num_microbatches=n
    )
    inputs, targets = torch.randn(ROWS * n, WIDTH), torch.zeros(ROWS * n, WIDTH)
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
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kinds", default="tensor,tuple,dict")
    parser.add_argument("--quick", action="store_true", help="5 repeats of 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.repeats = 10, 5
    pp, n = args.pp, args.microbatches
    hops = 2 * n * (pp - 1)  # forward activations and gradients, over every stage boundary
    print(f"# pipeline hops with small activations ({machine_line()})")
    print(
        f"# pp={pp}, n={n}, 1f1b, activations [{ROWS}, {WIDTH}], median of {args.repeats} x {args.iters} steps\n"
    )
    rows = []
    for kind in args.kinds.split(","):
        step = threadpar.launch(
            worker, kind, n, args.iters, args.repeats, world_size=pp, pp=pp, devices="cpu"
        )[0]
        rows.append([kind, fmt_time(step), fmt_time(step / hops)])
    print(table(["between stages", "step", "step / hops"], rows))


if __name__ == "__main__":
    main()
