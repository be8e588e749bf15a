"""Point to point on real GPUs: NCCL's device memory per communicator, and the host time of a send, a receive
and a pipeline step (issue 39's GPU figures).

    python -m benchmarks.gpu_p2p [--calls 300]

Needs two GPUs or more (NCCL puts one rank of a communicator on a GPU); says so and exits 0 otherwise.
- Memory: on n = min(8, GPUs) rank threads, each GPU's free memory (torch.cuda.mem_get_info) before and after
  the world group's communicator (an all-reduce makes it: NCCL_RUNTIME_CONNECT=0, every algorithm's buffers),
  after its pairs of neighbours are connected (group.connect, what a pipeline does), and after a plain send to
  the next rank and receive from the previous (two-rank communicators of their own, one per direction), less
  what torch's caching allocator reserved meanwhile: NCCL's own allocations, next to the estimate from NCCL's
  constants (tests/fakes/fake_nccl_memory.py).
- Host time per call on a rank thread: ProcessGroup.exchange (the pipelines' path) and plain send/recv (pairs
  of nonblocking communicators: NCCL's launch thread per call), rank 1 held while rank 0 sends, then rank 1
  receiving what was sent; and one 1F1B step of pp = min(4, GPUs) x 32 microbatches of Linear(256) stages.
Medians of repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"


def nccl_bytes(device: torch.device, before: tuple[int, int]) -> int:
    """Device memory taken since `before` (free, reserved) that torch's allocator did not reserve."""
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return (before[0] - free) - (reserved - before[1])


def mark(device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


def memory(n: int) -> list[list[str]]:
    import threadpar

    def body() -> list[int]:
        rank, device, group = threadpar.get_rank(), threadpar.get_device(), threadpar.get_group()
        t = torch.ones(1, device=device)
        start = mark(device)
        threadpar.all_reduce(t)
        world = nccl_bytes(device, start)
        start = mark(device)
        group.connect([(r, (r + 1) % n) for r in range(n)] + [(r, (r - 1) % n) for r in range(n)])
        neighbours = nccl_bytes(device, start)
        start = mark(device)
        threadpar.send(t, dst=(rank + 1) % n)
        threadpar.recv(torch.empty_like(t), src=(rank - 1) % n)
        threadpar.send(t, dst=(rank - 1) % n)
        threadpar.recv(torch.empty_like(t), src=(rank + 1) % n)
        pairs = nccl_bytes(device, start)
        return [world, neighbours, pairs]

    measured = threadpar.launch(body, world_size=n, backend="nccl", timeout=300)
    sys.path.insert(0, str(TESTS))
    from fakes.fake_nccl_memory import MIB, NcclMemoryModel

    model = NcclMemoryModel()
    peers = 1 if n == 2 else 2  # (with two ranks the next is the previous)
    estimates = [
        model.collectives(n),
        peers * model.peer(),
        peers * (2 * model.collectives(2) + model.peer()),
    ]
    what = [
        f"the world group's communicator ({n} ranks, all algorithms)",
        "its pairs of neighbours connected (both ways)",
        f"plain send/recv with the neighbours ({2 * peers} two-rank communicators)",
    ]
    rows = []
    for i, name in enumerate(what):
        values = [m[i] / MIB for m in measured]
        rows.append(
            [
                name,
                f"{statistics.median(values):.0f} MiB",
                f"{max(values):.0f} MiB",
                f"{estimates[i] / MIB:.0f} MiB",
            ]
        )
    return rows


def host_costs(calls: int, repeats: int) -> list[list[str]]:
    import threadpar

    turn = threading.Barrier(2)

    def body(path: str) -> tuple[float, float]:
        from benchmarks.p2p_host_cost import p2p_calls, timed_calls

        device = threadpar.get_device()
        t = torch.ones(256, device=device)
        send, receive = p2p_calls(path, t, [torch.empty(256, device=device) for _ in range(calls)])
        for _ in range(10):
            if threadpar.get_rank() == 0:
                send()
            else:
                receive(0)
        torch.cuda.synchronize(device)
        return timed_calls(turn, send, receive, calls, repeats, sync=lambda: torch.cuda.synchronize(device))

    rows = []
    for path, name in (
        ("exchange", "ProcessGroup.exchange (pipelines)"),
        ("plain", "plain send/recv (pairs)"),
    ):
        results = threadpar.launch(body, world_size=2, backend="nccl", kwargs={"path": path}, timeout=300)
        rows.append([name, f"{results[0][0] * 1e6:.1f} us", f"{results[1][1] * 1e6:.1f} us"])
    return rows


def pipeline_step(pp: int, steps: int) -> float:
    import threadpar
    from threadpar.pipeline import PipelineParallel, build_chunks

    def body() -> float:
        device = threadpar.get_device()
        g = torch.Generator().manual_seed(0)
        layers = [torch.nn.Linear(256, 256).to(device) for _ in range(pp)]
        chunks = build_chunks(layers, pp_size=pp, pp_rank=threadpar.get_coords().pp)
        pipe = PipelineParallel(chunks, loss_fn=lambda y, t: (y - t).square().mean(), num_microbatches=32)
        x, y = torch.randn(64, 256, generator=g).to(device), torch.randn(64, 256, generator=g).to(device)
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            pipe.train_step(x, y)  # (returns the loss: the host waits for the last stage's broadcast)
            if i >= 2:
                times.append(time.perf_counter() - began)
        return statistics.median(times)

    return max(threadpar.launch(body, world_size=pp, backend="nccl", pp=pp, timeout=300))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_p2p: needs CUDA GPUs; none here")
        return 0
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(
            f"gpu_p2p: needs two GPUs (NCCL puts one rank of a communicator on a GPU); this machine has {gpus}"
        )
        return 0
    from benchmarks.harness import machine_line, table

    n = min(8, gpus)
    print(f"# NCCL's device memory per GPU ({machine_line()}; {n} ranks): median and most over the GPUs\n")
    print(table(["communicators", "measured (median)", "measured (most)", "estimate"], memory(n)))
    print(
        f"\n# host time per call on a rank thread (2 GPUs); median of {args.repeats} repeats of {args.calls}\n"
    )
    print(table(["path", "send", "receive"], host_costs(args.calls, args.repeats)))
    pp = min(4, gpus)
    step = pipeline_step(pp, args.steps)
    print(
        f"\n# one 1F1B step, pp = {pp} x 32 microbatches of Linear(256): {step * 1e3:.2f} ms (median of {args.steps})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
