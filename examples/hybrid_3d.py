"""Recipe: DP x TP x PP on 8 rank threads (2 x 2 x 2): the pipeline schedule over the PP group, TP inside
each stage, DDP over the DP group with gradients averaged once per step, the whole model's gradient norm
clipped to 1 (one all-reduce over the launch). The same thing the demo
(`python -m threadpar.demo --gpus 8`) runs, in a page.

    python examples/hybrid_3d.py
"""

import torch

import threadpar
from threadpar.demo.data import Batches, data_parallel_slice, load_tokens
from threadpar.models.gpt import GPT, model_config
from threadpar.models.parallelize_gpt import parallelize_gpt
from threadpar.parallel import clip_grad_norm_

LR = 1e-2
MAX_NORM = 1.0  # the whole model's gradient norm is clipped to this, as LLM recipes do
CONFIG = model_config("small", block_size=32)


def train(dense: dict, batches: Batches, steps: int) -> list[float]:
    layout, coords = threadpar.get_layout(), threadpar.get_coords()
    model = parallelize_gpt(CONFIG, dense, schedule="interleaved", num_microbatches=4, sequence_parallel=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = batches.batch(step)  # the global batch; this replica takes its share
        inputs = data_parallel_slice(inputs, coords.dp, layout.dp)
        targets = data_parallel_slice(targets, coords.dp, layout.dp)
        loss = model.train_step(inputs, targets)
        clip_grad_norm_(model.parameters(), MAX_NORM)  # the norm over every shard, stage and replica
        optimizer.step()
        optimizer.zero_grad()
        threadpar.all_reduce(loss, op="avg", group="DP")  # the global batch's mean loss
        losses.append(loss.item())
    threadpar.print0(f"3D on {layout.describe()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def start() -> tuple[dict, Batches]:
    """The dense model's initial weights and the data (the same for the parallel run and any reference)."""
    dense = GPT(CONFIG).init_weights(torch.Generator().manual_seed(0)).state_dict()
    return dense, Batches(load_tokens(None), batch_size=16, seq_len=32, seed=0)


def main(steps: int = 30) -> list[float]:
    dense, batches = start()
    return threadpar.launch(
        train, dense, batches, steps, world_size=8, dp=2, tp=2, pp=2, devices="cpu", print_layout=True
    )[0]


if __name__ == "__main__":
    main()
