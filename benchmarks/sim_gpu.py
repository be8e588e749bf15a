"""What the CUDA double's simulated device costs: the same training code on host tensors and on the double's GPUs.

The double's GPU tensors (tests/fakes/sim_gpu.py: `simgpu:i`, a PrivateUse1 device backed by host memory) send
every op through Python (the wrapper subclass's `__torch_dispatch__`: device checks, stream order, the copy
model), where host tensors go straight to ATen. Two measurements, medians of repeated runs, ratios against the
host:
- one thread, one GPT training step (forward, backward, AdamW) on host tensors and on `simgpu:0`;
- a launch of 4 ranks training that GPT under DDP: the threads backend on host ranks (the anchor: what a CPU
  test of the same code runs) and the nccl backend on the double's GPUs (what a test of the GPU path runs,
  `threadpar.launch` inside fake_cuda_nccl.simulated_gpus).

    python -m benchmarks.sim_gpu [--quick]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import threadpar
from benchmarks.harness import machine_line, median_time, repeats_of, repeats_parser, table
from threadpar.models.gpt import GPT, GPTConfig
from threadpar.parallel import DistributedDataParallel

TESTS = Path(__file__).resolve().parent.parent / "tests"
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)
WORLD, STEPS = 4, 3


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits [B, T, vocab], targets [B, T]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(device: torch.device) -> Callable[[], None]:
    """One GPT step on `device` (its model, optimizer and batch made there, as GPU code makes them)."""
    with torch.device(device):
        model = GPT(CONFIG).init_weights(torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(
        0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=torch.Generator().manual_seed(1)
    )
    x = x.to(device)

    def step() -> None:
        loss = lm_loss(model(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # (a device-to-host read, as a training loop's logging makes)

    return step


def ddp_body() -> float:
    """A rank's DDP steps of the GPT on its device; returns its last loss."""
    device = threadpar.get_device()
    with torch.device(device):
        model = GPT(CONFIG).init_weights(torch.Generator().manual_seed(0))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(threadpar.get_rank())
    loss = torch.zeros(())
    for _ in range(STEPS):
        x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=g).to(device)
        loss = lm_loss(ddp(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def timed(fn: Callable[[], list[float]], repeats: int) -> tuple[float, list[float]]:
    """The median seconds of `repeats` calls, and the last call's result."""
    samples, result = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2], result


def main(argv: list[str] | None = None) -> int:
    args = repeats_parser(__doc__).parse_args(argv)
    repeats = repeats_of(args)
    sys.path.insert(0, str(TESTS))
    from fakes import sim_gpu
    from fakes.fake_cuda_nccl import FakeCuda, simulated_gpus

    torch.set_num_threads(1)
    fake = FakeCuda()
    host_step = train_step(torch.device("cpu"))
    previous = sim_gpu.bind(fake)  # (this thread drives the double's GPU 0)
    try:
        device_step = train_step(sim_gpu.device(0))
        host_s = median_time(host_step, iters=3, repeats=repeats)
        device_s = median_time(device_step, iters=3, repeats=repeats)
    finally:
        sim_gpu.bind(previous)

    def host_launch() -> list[float]:
        return threadpar.launch(ddp_body, world_size=WORLD, backend="threads")

    def device_launch() -> list[float]:
        with simulated_gpus(FakeCuda(), WORLD):
            return threadpar.launch(ddp_body, world_size=WORLD, backend="nccl")

    host_launch(), device_launch()  # (warm-up: imports, first compiles of torch's dispatch paths)
    (launch_host_s, host_losses), (launch_device_s, device_losses) = (
        timed(host_launch, repeats),
        timed(device_launch, repeats),
    )
    same = torch.allclose(torch.tensor(host_losses), torch.tensor(device_losses), rtol=1e-5, atol=1e-6)
    print(
        f"# the double's simulated device against host tensors: GPT {CONFIG.n_layer} layers x {CONFIG.n_embd}, "
        f"medians of {repeats} ({machine_line()})\n"
    )
    rows = [
        [
            "one thread: a training step",
            f"{host_s * 1e3:.1f} ms",
            f"{device_s * 1e3:.1f} ms",
            f"{device_s / host_s:.2f}x",
            "",
        ],
        [
            f"launch of {WORLD} ranks, DDP, {STEPS} steps",
            f"{launch_host_s:.2f} s",
            f"{launch_device_s:.2f} s",
            f"{launch_device_s / launch_host_s:.2f}x",
            "yes" if same else f"no: {host_losses} vs {device_losses}",
        ],
    ]
    print(table(["what", "host tensors", "double's GPUs", "ratio", "same losses"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
