"""Recipe: tensor parallelism only, on a model written without threadpar. `parallelize` swaps its
nn.Linear layers for column/row-parallel ones and keeps each rank's shard of the weights, so the split
model computes what the dense one does (checked below against the dense model).

    python examples/tp_only.py
"""

import copy

import torch
from torch import nn

import threadpar
from threadpar.parallel import parallelize


class MyMLP(nn.Module):  # plain PyTorch: nothing here knows about threadpar
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def train(dense: nn.Module, steps: int) -> float:
    model = copy.deepcopy(dense)
    parallelize(model, {"up": "colwise", "down": "rowwise"})  # this rank keeps 1/tp of each weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)  # every TP rank sees the same input
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data)
        loss = (model(x) - x).pow(2).mean()  # learn the identity
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    threadpar.print0(f"TP on {threadpar.get_world_size()} ranks: final loss {loss.item():.5f}")
    return loss.item()


def dense_reference(dense: nn.Module, steps: int) -> float:
    model = copy.deepcopy(dense)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def main(steps: int = 100) -> tuple[float, float]:
    torch.manual_seed(0)
    dense = MyMLP()
    tp_loss = threadpar.launch(train, dense, steps, world_size=4, tp=4, devices="cpu")[0]
    ref_loss = dense_reference(dense, steps)
    print(f"dense model, one thread: final loss {ref_loss:.5f}")
    return tp_loss, ref_loss


if __name__ == "__main__":
    main()
