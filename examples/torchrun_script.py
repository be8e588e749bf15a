"""A training script written for torchrun, unchanged for threadpar: one process per rank, or one thread per rank.

    torchrun --nproc-per-node 4 examples/torchrun_script.py --steps 5 --checkpoint /tmp/ckpt.pt
    python -m threadpar.run --nproc-per-node 4 examples/torchrun_script.py --steps 5 --checkpoint /tmp/ckpt.pt

It reads its place from torchrun's environment variables, initialises gloo through env://, seeds per rank,
trains an MLP with DDP on data of its own rank, has rank 0 save a checkpoint, prints one line of losses per
rank ("rank R (local L) losses: [...]") and ends with sys.exit(0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    dist.init_process_group("gloo", init_method="env://")
    assert dist.get_rank() == rank and dist.get_world_size() == world_size

    torch.manual_seed(1234)  # the same initial weights on every rank (DDP checks them)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(args.hidden, 1),
    )
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    torch.manual_seed(100 + rank)  # each rank its own data and dropout masks
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 16)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"rank {rank} (local {local_rank}) losses: [{' '.join(f'{v:.6f}' for v in losses)}]", flush=True)
    if rank == 0 and args.checkpoint:
        torch.save(model.state_dict(), args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
