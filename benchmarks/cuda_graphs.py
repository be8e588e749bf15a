"""A rank's training step, eager and as a CUDA graph (threadpar.graphed_step), side by side.

    python -m benchmarks.cuda_graphs            # on a GPU: GPT-2 small's shape; always: the CPU model
    python -m benchmarks.cuda_graphs --quick

On a GPU (world 1, the nccl backend), for GPT-2 small's shape (12 x 768, 12 heads, AdamW capturable):
- 1 x 128 tokens, fp32 (a host-bound step) and 8 x 1024 tokens, bf16 autocast (a device-bound one): wall
  time per step (20 steps between two device synchronizations), the rank thread's CPU time per step (what
  it holds the GIL for, roughly: its Python and the CUDA calls), the graphed/eager ratios, the capture's
  seconds and the memory it reserved (torch.cuda.memory_reserved before and after);
- the projection to 8 GPUs in one process: a step there takes about max(device, 8 x host) while eight rank
  threads share one GIL, against max(device, host) for 8 processes, with the device time taken as the
  graphed step's wall time.
Ranks sharing one GPU are not graphed (their collectives are host meetings on the threads backend).

Without a GPU, and always: the CPU model of capture and replay (tests/fakes: the project's CUDA/NCCL double,
fake_graph.py), world 2, a DDP MLP step and a 1F1B pipeline's (2 stages, its sends and receives graphed
too): the losses of 10 steps graphed and eager (they must be identical),
and the Python calls per step on a rank thread, eager against a replay (threadpar's own; the double's frames,
which stand for the GPU's work, are not counted). Medians of --rounds rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import threadpar
from benchmarks.harness import machine_line, table
from threadpar.models.config import GPTConfig
from threadpar.models.gpt import GPT

GPT2_SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
CASES = {  # name -> (tokens per sequence, sequences, autocast dtype)
    "1 x 128 tokens, fp32 (host-bound)": (128, 1, None),
    "8 x 1024 tokens, bf16 (device-bound)": (1024, 8, torch.bfloat16),
}
TESTS = Path(__file__).resolve().parent.parent / "tests"


# -- on a GPU ----------------------------------------------------------------------------------------------------
def gpu_case(seq: int, batch: int, dtype: torch.dtype | None, steps: int, rounds: int) -> dict[str, float]:
    def body() -> dict[str, float]:
        device = threadpar.get_device()
        torch.manual_seed(0)
        model = GPT(GPT2_SMALL, autocast_dtype=dtype).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
        x = torch.randint(0, GPT2_SMALL.vocab_size, (batch, seq), device=device)
        y = torch.randint(0, GPT2_SMALL.vocab_size, (batch, seq), device=device)

        def train(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=False)
            loss = model.loss(inputs, targets)
            loss.backward()
            optimizer.step()
            return loss.detach()

        graphed = threadpar.graphed_step(train, warmup_steps=3)
        for _ in range(3):
            train(x, y)
            graphed(x, y)  # (its warm-up)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        graphed(x, y)  # the capture
        torch.cuda.synchronize()
        out: dict[str, list[float]] = {
            "eager wall": [],
            "eager host": [],
            "graphed wall": [],
            "graphed host": [],
        }
        for _ in range(rounds):
            for name, step in (("eager", train), ("graphed", graphed)):
                torch.cuda.synchronize()
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    step(x, y)
                host = (time.thread_time() - cpu) / steps
                torch.cuda.synchronize()
                out[f"{name} wall"].append((time.perf_counter() - wall) / steps)
                out[f"{name} host"].append(host)
        result = {k: statistics.median(v) for k, v in out.items()}
        result["capture s"] = graphed.capture_seconds or float("nan")
        result["graph MiB"] = (torch.cuda.memory_reserved() - reserved) / 2**20
        return result

    return threadpar.launch(body, world_size=1, backend="nccl")[0]


def gpu_tables(steps: int, rounds: int) -> None:
    rows, projection = [], []
    for name, (seq, batch, dtype) in CASES.items():
        r = gpu_case(seq, batch, dtype, steps, rounds)
        ms = {k: v * 1e3 for k, v in r.items() if k.endswith(("wall", "host"))}
        rows.append([
            name, f"{ms['eager wall']:.2f}", f"{ms['graphed wall']:.2f}", f"{r['graphed wall'] / r['eager wall']:.2f}x",
            f"{ms['eager host']:.2f}", f"{ms['graphed host']:.3f}", f"{r['capture s']:.2f}", f"{r['graph MiB']:.0f}",
        ])  # fmt: skip
        device = r["graphed wall"]
        for mode in ("eager", "graphed"):
            host = r[f"{mode} host"]
            one_process, processes = max(device, 8 * host), max(device, host)
            projection.append([
                name, mode, f"{host * 1e3:.3f}", f"{device * 1e3:.2f}", f"{one_process * 1e3:.2f}",
                f"{processes * 1e3:.2f}", f"{processes / one_process:.2f}x",
            ])  # fmt: skip
    print("## one GPU, world 1 (ms per step; medians)\n")
    headers = ["case", "eager wall", "graphed wall", "graphed / eager", "eager host", "graphed host", "capture s",
               "graph MiB"]  # fmt: skip
    print(table(headers, rows))
    print("\n## 8 GPUs projected: one process (8 rank threads, one GIL) vs 8 processes (ms per step)\n")
    headers = ["case", "step", "host per rank", "device", "1 process: max(device, 8 x host)",
               "8 processes: max(device, host)", "1 process / 8 processes"]  # fmt: skip
    print(table(headers, projection))


# -- the CPU model ----------------------------------------------------------------------------------------------
# The double's frames, and torch's Python that runs its dispatch modes (DeviceTouch, the recorder): on a GPU
# neither exists, so neither is counted (nor what they call).
DOUBLE_FILES = (
    "/tests/fakes/", "/torch/utils/_python_dispatch.py", "/torch/_library/simple_registry.py", "/torch/_compile.py",
    "/torch/_dynamo/eval_frame.py", "/torch/compiler/__init__.py",
)  # fmt: skip


class CallCounter:
    """Python function calls on this thread while counting, leaving out the double's frames and theirs."""

    def __init__(self) -> None:
        self.calls = 0
        self._inside = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if self._inside or any(part in path for part in DOUBLE_FILES):
                self._inside += 1
            else:
                self.calls += 1
        elif event == "return" and self._inside:
            self._inside -= 1

    @contextlib.contextmanager
    def counting(self):
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)


def _ddp_mlp(steps: int) -> Any:
    """A DDP MLP's step: make() -> (train, the rank's arguments of step i)."""
    from threadpar.parallel import DistributedDataParallel

    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)) for _ in range(steps)]

    def make() -> tuple[Any, Any]:
        rank = threadpar.get_rank()
        model = DistributedDataParallel(copy.deepcopy(template).to(threadpar.get_device()))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)

        def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return train, lambda i: (data[i][0].chunk(2)[rank], data[i][1].chunk(2)[rank])

    return make


def _pipeline(steps: int) -> Any:
    """A 1F1B pipeline's step, 2 stages x 4 microbatches: its sends and receives in the graph too."""
    from test_pipeline_executor import lm_loss, make_batch, make_model, my_chunks

    from threadpar.pipeline import PipelineParallel

    data = [make_batch(8, seed=10 + i) for i in range(steps)]

    def make() -> tuple[Any, Any]:
        model = make_model(4).to(threadpar.get_device())
        pipe = PipelineParallel(my_chunks(model, 1), loss_fn=lm_loss, schedule="1f1b", num_microbatches=4)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.01, capturable=True)

        def train(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = pipe.train_step(inputs, targets)
            opt.step()
            return loss

        return train, lambda i: data[i]

    return make


def cpu_model(steps: int) -> list[list[str]]:
    sys.path.insert(0, str(TESTS))
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    cases = {  # name -> (make, the launch's layout)
        f"DDP MLP, 2 ranks, {steps} steps": (_ddp_mlp(steps), {}),
        f"1F1B pipeline, 2 stages x 4 microbatches, {steps} steps": (_pipeline(steps), {"pp": 2}),
    }
    rows = []
    for name, (make, layout) in cases.items():

        def run(graphed: bool, make: Any = make, layout: dict = layout) -> list[Any]:
            def body() -> tuple[torch.Tensor, int]:
                train, batch = make()
                step = threadpar.graphed_step(train, warmup_steps=2) if graphed else train
                losses, counter, dev = [], CallCounter(), threadpar.get_device()
                for i in range(steps):
                    inputs = [t.to(dev) for t in batch(i)]  # (the copy to the device: outside the count)
                    if i == steps - 1 and threadpar.get_rank() == 0:
                        with counter.counting():
                            losses.append(step(*inputs).clone())
                    else:
                        losses.append(step(*inputs).clone())
                return torch.stack(losses).cpu(), counter.calls

            return run_fake_gpus(body, 2, FakeCuda(), **layout)

        graphed, eager = run(True), run(False)
        same = all(torch.equal(g[0], e[0]) for g, e in zip(graphed, eager))
        rows.append([name, str(same), str(eager[0][1]), str(graphed[0][1]),
                     f"{eager[0][1] / max(1, graphed[0][1]):.0f}x"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round (GPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 round")
    args = parser.parse_args(argv)
    steps, rounds = (5, 1) if args.quick else (args.steps, args.rounds)
    print(f"# a training step, eager and as a CUDA graph ({machine_line()})\n")
    if torch.cuda.is_available():
        gpu_tables(steps, rounds)
    else:
        print("no GPU: the CUDA graph timings need one (the CPU model below runs everywhere)")
    print("\n## CPU model of capture and replay (the project's CUDA/NCCL double)\n")
    headers = ["step", "graphed losses == eager", "Python calls, eager step", "Python calls, replayed step",
               "eager / replayed"]  # fmt: skip
    print(table(headers, cpu_model(10)))
    print("\n(ranks sharing one GPU are not graphed: their collectives meet on the host, threads backend)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
