"""Writes examples/train_gpt.ipynb (kept as code so the notebook's source is reviewable and outputs stay out
of git): `python examples/make_notebook.py`."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        "# Training a GPT with threadpar, step by step\n\n"
        "One process, one thread per rank: on a GPU node each rank thread drives a GPU, without GPUs the ranks "
        "are CPU threads. Each `threadpar.launch` starts the rank threads, runs a function on each, and "
        "returns what they return; the model lives in this kernel's memory between launches."
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "import torch\n\n"
        "import threadpar\n"
        "from threadpar.checkpoint import load_optimizer_state\n"
        "from threadpar.demo.data import Batches, data_parallel_slice, load_tokens\n"
        "from threadpar.models.gpt import GPT, model_config\n"
        "from threadpar.models.parallelize_gpt import parallelize_gpt"
    ),
    new_markdown_cell("## The layout: 8 ranks as 2 (data) x 2 (tensor) x 2 (pipeline)"),
    new_code_cell("print(threadpar.Layout.build(8, tp=2, pp=2).overview())"),
    new_markdown_cell(
        "## The model and the data\n\n"
        "The weights start as one dense state dict in host memory. Every launch loads its shards of it and "
        "hands the trained weights back, dense again: that dict *is* the checkpoint."
    ),
    new_code_cell(
        'config = model_config("tiny", block_size=64)\n'
        "state = {\n"
        '    "model": GPT(config).init_weights(torch.Generator().manual_seed(0)).state_dict(),\n'
        '    "optimizer": None,\n'
        '    "step": 0,\n'
        "}\n"
        "batches = Batches(load_tokens(None), batch_size=32, seq_len=64, seed=0)  # batch(step) is the same on every rank\n"
        "history = []"
    ),
    new_markdown_cell(
        "## A training function, run by every rank thread\n\n"
        "`parallelize_gpt` builds this rank's pipeline chunks from tensor-parallel layers, loads its shard of "
        "the dense weights and wraps DDP over the data-parallel group."
    ),
    new_code_cell(
        "def train(steps):\n"
        "    layout, coords = threadpar.get_layout(), threadpar.get_coords()\n"
        '    model = parallelize_gpt(config, state["model"], schedule="1f1b", num_microbatches=4)\n'
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, betas=(0.9, 0.95))\n"
        '    if state["optimizer"] is not None:\n'
        '        load_optimizer_state(optimizer, model.chunks, state["optimizer"])\n'
        "    losses = []\n"
        '    for step in range(state["step"], state["step"] + steps):\n'
        "        inputs, targets = batches.batch(step)\n"
        "        inputs = data_parallel_slice(inputs, coords.dp, layout.dp)\n"
        "        targets = data_parallel_slice(targets, coords.dp, layout.dp)\n"
        "        loss = model.train_step(inputs, targets)\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        '        threadpar.all_reduce(loss, op="avg", group="DP")\n'
        "        losses.append(loss.item())\n"
        "    # Dense weights and optimizer moments, one part per pipeline stage (collectives over each TP group).\n"
        "    weights, moments = model.dense_state(), model.dense_optimizer_state(optimizer)\n"
        "    return losses, (weights, moments) if coords.dp == 0 and coords.tp == 0 else None\n"
        "\n\n"
        "def run(steps):\n"
        "    results = threadpar.launch(train, steps, world_size=8, tp=2, pp=2)\n"
        "    parts = [part for _, part in results if part is not None]\n"
        '    state["model"] = {k: v for weights, _ in parts for k, v in weights.items()}\n'
        '    state["optimizer"] = {k: v for _, moments in parts for k, v in moments.items()}\n'
        '    state["step"] += steps\n'
        "    history.extend(results[0][0])\n"
        "    print(f\"step {state['step']}: loss {history[-1]:.3f}\")"
    ),
    new_code_cell("run(30)"),
    new_markdown_cell("Run it again: the next launch starts fresh threads and continues from `state`."),
    new_code_cell("run(30)"),
    new_code_cell(
        "plt.figure(figsize=(6, 3))\n"
        "plt.plot(range(1, len(history) + 1), history)\n"
        'plt.xlabel("step")\n'
        'plt.ylabel("loss")\n'
        "plt.show()"
    ),
    new_markdown_cell(
        "## A checkpoint a plain single-thread GPT can load\n\n"
        "The state dict is unsplit, so it loads into `GPT` directly, and a later run may resume it with "
        "any other (dp, tp, pp)."
    ),
    new_code_cell(
        'torch.save({"config": config.to_dict(), **state}, "gpt_checkpoint.pt")\n'
        'plain = GPT.from_checkpoint("gpt_checkpoint.pt")\n'
        'inputs, targets = batches.batch(state["step"])\n'
        'print(f"plain single-thread GPT from the checkpoint: loss {plain.loss(inputs, targets).item():.3f} on the next batch")'
    ),
    new_markdown_cell(
        "Interrupt the kernel while a launch runs (the stop button, or Ctrl-C): every rank thread stops, "
        "the cell raises `KeyboardInterrupt`, and the next cell runs normally."
    ),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


if __name__ == "__main__":
    path = Path(__file__).with_name("train_gpt.ipynb")
    nbformat.write(build(), path)
    print(f"wrote {path}")
