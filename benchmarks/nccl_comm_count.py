"""NCCL communicators per rank, and NCCL's device memory for them, for the GPT on 8 GPUs of one node.

    python -m benchmarks.nccl_comm_count [--steps 2]

For each layout (dp8, tp8, pp8, dp2 x tp2 x pp2, cp2 x dp4) the GPT (parallelize_gpt: DDP, TP, the 1F1B
pipeline, ring attention) trains a few steps on the CUDA/NCCL test double (tests/fakes), which records every
communicator each rank makes, the collectives each runs and the peers each sends to or receives from. Per
rank (the most any rank holds): the communicators and an estimate of NCCL's device memory for them from NCCL's
own constants (tests/fakes/fake_nccl_memory.py: 9.19 MiB of LL/LL128/SIMPLE buffers per connection and
channel, src/init.cc computeBuffSizes; ring, tree and NVLS channels; p2pnChannelsPerPeer per peer; the channel
counts of an 8-GPU NVSwitch node, MAXCHANNELS = 32). Side by side, from the same run's messages:

- threadpar: what this run made (NCCL_RUNTIME_CONNECT=0, threadpar's setting: every algorithm's buffers at
  creation, so that no later collective waits for its peers inside NCCL).
- threadpar before issue 39: the groups that ran collectives, plus two two-rank communicators per peer a rank
  exchanged messages with (one per direction, both made at the pair's first message), each with its own ring
  buffers at creation.
- torch's ProcessGroupNCCL, by its rules (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): one communicator
  per group used, and for a lone send/recv one per unordered pair of ranks (getKeySendRecv); batched point to
  point (batch_isend_irecv, torch.distributed.pipelining's and Megatron's way) on the group's own. Its
  memory twice: in threadpar's environment (NCCL_RUNTIME_CONNECT=0) and under NCCL's default (=1: a
  communicator connects an algorithm at its first use, so one used only for point to point holds only its
  peers' buffers; a group that ran collectives is counted with all of them, as a training run's sizes reach
  every algorithm).

No GPU is needed (the double's communicators stand for NCCL's); `benchmarks.gpu_check` measures the memory
(torch.cuda.mem_get_info before and after) where a GPU is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

import threadpar
from benchmarks.harness import machine_line, table

TESTS = Path(__file__).resolve().parent.parent / "tests"
LAYOUTS = {
    "dp8": {"dp": 8},
    "tp8": {"tp": 8},
    "pp8": {"pp": 8},
    "dp2 x tp2 x pp2": {"dp": 2, "tp": 2, "pp": 2},
    "cp2 x dp4": {"cp": 2, "dp": 4},
}
WORLD = 8


def run_layout(layout: dict[str, int], steps: int) -> list[list[Any]]:
    """Per rank: the CommUsage of each communicator it holds after `steps` training steps."""
    sys.path.insert(0, str(TESTS))
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    from threadpar.models.gpt import GPT, GPTConfig
    from threadpar.models.parallelize_gpt import parallelize_gpt

    config = GPTConfig(n_layer=8, n_head=8, n_embd=32, block_size=16)
    dense = GPT(config).init_weights(torch.Generator().manual_seed(0)).state_dict()
    pp = layout.get("pp", 1)
    fake = FakeCuda()

    def body() -> list[Any]:
        model = parallelize_gpt(config, dense, num_microbatches=2 * pp)
        g, device = torch.Generator().manual_seed(1), threadpar.get_device()  # (the double's GPU: simgpu:i)
        for _ in range(steps):
            x = torch.randint(0, config.vocab_size, (4 * pp, config.block_size), generator=g).to(device)
            model.train_step(x, x)
        gpu = threadpar.get_rank()  # (the double numbers its GPUs by rank)
        return [fake.nccl.usage(c) for c in fake.nccl.live_communicators(gpu)]

    return run_fake_gpus(body, WORLD, fake, timeout=60, **layout)


def price(usages: list[Any], model: Any) -> dict[str, tuple[int, int, int]]:
    """One rank's (communicators, bytes at NCCL_RUNTIME_CONNECT=0, bytes at NCCL's default) under each rule
    (module docstring), from what its communicators were used for."""
    collective_groups = [u.size for u in usages if u.collectives]
    groups = sum(model.collectives(size) for size in collective_groups)
    peers = sum(len(u.sends_to | u.receives_from) for u in usages)  # ranks it exchanged messages with
    received = sum(len(u.receives_from) for u in usages) * model.peer()  # its point-to-point buffers
    now = (len(usages), sum(model.collectives(u.size) for u in usages) + received, groups + received)
    before = (len(collective_groups) + 2 * peers, groups + 2 * peers * model.collectives(2) + received, 0)
    pairs = (
        len(collective_groups) + peers,
        groups + peers * model.collectives(2) + received,
        groups + received,
    )
    return {"now": now, "before": before, "torch batched": now, "torch pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="these layouts only")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from fakes.fake_nccl_memory import MIB, NcclMemoryModel

    model = NcclMemoryModel()
    print(
        f"# NCCL communicators and NCCL device memory per rank (the most any rank holds), GPT on {WORLD} GPUs of "
        f"one node, from the double's record of {args.steps} training steps ({machine_line()}); memory model: "
        f"{model.channels} channels, {model.p2p_channels_per_peer} p2p channels per peer, NVLS "
        f"{'on' if model.nvls else 'off'} (tests/fakes/fake_nccl_memory.py)\n"
    )
    rows = []
    for name, layout in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        per_rank = [price(usages, model) for usages in run_layout(layout, args.steps)]

        def most(rule: str, i: int, per_rank: list = per_rank) -> int:
            return max(p[rule][i] for p in per_rank)

        def gib(rule: str, i: int) -> str:
            return f"{most(rule, i) / (1024 * MIB):.2f}"

        rows.append(
            [
                name,
                most("now", 0),
                most("before", 0),
                most("torch pairs", 0),
                most("torch batched", 0),
                gib("now", 1),
                gib("before", 1),
                gib("torch pairs", 1),
                gib("torch pairs", 2),
                gib("torch batched", 2),
                "yes" if most("now", 0) <= min(most("torch pairs", 0), most("torch batched", 0)) else "NO",
                "yes" if most("now", 1) <= most("torch pairs", 1) else "NO",
            ]
        )
    headers = [
        "layout",
        "comms: threadpar",
        "before",
        "torch send/recv",
        "torch batched",
        "GiB: threadpar",
        "before",
        "torch send/recv",
        "torch send/recv, NCCL default",
        "torch batched, NCCL default",
        "comms <= torch",
        "GiB <= torch (same env.)",
    ]
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
