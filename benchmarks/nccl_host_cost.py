"""Host time per call of a 4-byte all-reduce on one GPU, by the way into NCCL: threadpar's binding of NCCL's
C API, threadpar's all_reduce on a rank thread (nccl backend, world 1), torch.cuda.nccl.all_reduce with
comms=None (torch's own ncclCommInitAll per device list), and torch.distributed's ProcessGroupNCCL (world 1).
Median over repeats of (calls' host time / calls); the device is synchronized after each repeat. Ratios are
to the binding. Without CUDA it says so and exits 0.

    python -m benchmarks.nccl_host_cost [--calls 500 --repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def per_call_us(call: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(10):  # warm-up: communicators connected, kernels loaded
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def binding(calls: int, repeats: int) -> float:
    from threadpar.comm.nccl.library import SUM, nccl_library

    lib = nccl_library()
    comm = lib.comm_init_rank(1, lib.get_unique_id(), 0, 0)
    x, stream = torch.ones(1, device="cuda"), torch.cuda.current_stream()
    try:
        return per_call_us(lambda: lib.all_reduce(x, x, SUM, comm, stream), calls, repeats)
    finally:
        lib.comm_destroy(comm)


def torch_cuda_nccl(calls: int, repeats: int) -> float:
    import torch.cuda.nccl as nccl

    x = torch.ones(1, device="cuda")
    return per_call_us(lambda: nccl.all_reduce([x]), calls, repeats)


def threadpar_rank_thread(calls: int, repeats: int) -> float:
    import threadpar

    def body() -> float:
        x = torch.ones(1, device=threadpar.get_device())
        return per_call_us(lambda: threadpar.all_reduce(x), calls, repeats)

    return threadpar.launch(body, world_size=1, backend="nccl")[0]


def process_group_nccl(calls: int, repeats: int) -> float:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            x = torch.ones(1, device="cuda")
            return per_call_us(lambda: dist.all_reduce(x), calls, repeats)
        finally:
            dist.destroy_process_group()


WAYS = {
    "threadpar binding (ncclAllReduce via ctypes)": binding,
    "threadpar.all_reduce, rank thread, nccl backend": threadpar_rank_thread,
    "torch.cuda.nccl.all_reduce, comms=None": torch_cuda_nccl,
    "torch.distributed ProcessGroupNCCL, world 1": process_group_nccl,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nccl_host_cost: needs a CUDA GPU; none here")
        return 0
    rows: dict[str, float | str] = {}
    for name, way in WAYS.items():
        try:
            rows[name] = way(args.calls, args.repeats)
        except Exception as error:  # one way failing (e.g. torch.cuda.nccl on an old torch) is a result too
            rows[name] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    base = rows[next(iter(WAYS))]
    print("| way into NCCL (4 B all-reduce, 1 GPU) | host us / call | vs binding |\n|---|---|---|")
    for name, value in rows.items():
        if isinstance(value, float):
            ratio = f"{value / base:.2f}x" if isinstance(base, float) else "-"
            print(f"| {name} | {value:.1f} | {ratio} |")
        else:
            print(f"| {name} | {value} | - |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
