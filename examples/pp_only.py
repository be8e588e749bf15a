"""Recipe: pipeline parallelism only. The GPT's layers are cut into 4 stages (one rank thread each);
each step runs 8 microbatches with the 1F1B schedule, and the timeline shows how the stages overlapped.

    python examples/pp_only.py
"""

import torch

import threadpar
from threadpar.demo.data import Batches, load_tokens
from threadpar.models.gpt import GPT, model_config
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.pipeline import measured_bubble

LR = 2e-2
CONFIG = model_config("tiny", block_size=32)


def train(dense: dict, batches: Batches, steps: int, timelines: dict) -> list[float]:
    model = parallelize_gpt(CONFIG, dense, schedule="1f1b", num_microbatches=8)  # pp = world size here
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = batches.batch(step)  # only the first stage uses inputs, the last targets
        losses.append(model.train_step(inputs, targets).item())
        optimizer.step()
        optimizer.zero_grad()
    timelines[threadpar.get_rank()] = model.pipeline.timeline.snapshot()
    threadpar.print0(f"PP over {threadpar.get_world_size()} stages: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def start() -> tuple[dict, Batches]:
    """The dense model's initial weights and the data (the same for the parallel run and any reference)."""
    dense = GPT(CONFIG).init_weights(torch.Generator().manual_seed(0)).state_dict()
    return dense, Batches(load_tokens(None), batch_size=16, seq_len=32, seed=0)


def main(steps: int = 40) -> list[float]:
    dense, batches = start()
    timelines: dict = {}
    losses = threadpar.launch(train, dense, batches, steps, timelines, world_size=4, pp=4, devices="cpu")[0]
    print(f"measured bubble of the last step: {measured_bubble(timelines.values()):.1%}")
    return losses


if __name__ == "__main__":
    main()
