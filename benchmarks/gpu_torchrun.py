"""benchmarks.gpu's anchor: the same measurements with torch.distributed and NCCL, one process per GPU.

    torchrun --standalone --nproc-per-node=N -m benchmarks.gpu_torchrun --out result.json [--repeats R]

(benchmarks.gpu starts it; `--cpu` runs it on gloo and CPU for a smoke run on a machine without GPUs.)
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_work import GptShape, all_reduce_times, ddp_gpt_step_time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpt", required=True, help="size,seq_len,batch_per_rank (GptShape.as_arg)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU: a smoke run of this script")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if args.cpu else "nccl", device_id=None if args.cpu else device)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp_options: dict[str, Any] = {} if args.cpu else {"device_ids": [local_rank]}
        result = {
            "all_reduce": all_reduce_times(dist, device, world, args.sizes, args.repeats),
            "ddp_step": ddp_gpt_step_time(
                lambda m: torch.nn.parallel.DistributedDataParallel(m, **ddp_options),
                dist, GptShape.parse(args.gpt), rank, device, args.steps, args.repeats,
            ),
        }  # fmt: skip
        # Every rank's time ends at the barrier of its next repeat, so rank 0's medians are the group's.
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
