"""Recipe: data parallelism only. Four rank threads each train a replica of an MLP on their quarter of
every batch; DistributedDataParallel averages the gradients in buckets while backward runs.

    python examples/ddp_only.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.parallel import DistributedDataParallel


def train(steps: int) -> list[float]:
    rank, world = threadpar.get_rank(), threadpar.get_world_size()
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
    # DDP broadcasts rank 0's initial weights, so every replica starts equal.
    model = DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(0)  # the same global batches on every rank
    teacher = torch.randn(32, 1, generator=data) / 4
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=data)
        y = torch.tanh(x @ teacher)  # something to learn
        mine = slice(rank * 64 // world, (rank + 1) * 64 // world)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # gradients are averaged over the ranks here
        optimizer.step()
        optimizer.zero_grad()
        threadpar.all_reduce(loss.detach(), op="avg")
        losses.append(loss.item())
    threadpar.print0(f"DDP on {world} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


def main(steps: int = 200) -> list[float]:
    return threadpar.launch(
        train, steps, world_size=4, devices="cpu" if not torch.cuda.is_available() else None
    )[0]


if __name__ == "__main__":
    main()
