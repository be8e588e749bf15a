"""Global gradient clipping: threadpar's clip_grad_norm_ on TP-sharded gradients vs torch.distributed over
gloo (one process per rank) doing the same by hand, and vs torch's clip_grad_norm_ of the dense model.

    python -m benchmarks.clip            # tp = 2 and 4
    python -m benchmarks.clip --quick    # fewer repeats

The model is the DDP benchmark's MLP, 4 x Linear(1024, 1024) (16 MiB of fp32 gradients), its weights split
over tp ranks (each holds 1/tp of every weight, biases replicated). A clip is: the local p-norm of the
counted pieces, one all-reduce of |g|^2, the scale of every gradient. The gloo side is what a
torch.distributed user writes: torch.nn.utils.get_total_norm on the shards, all_reduce of its square,
torch.nn.utils.clip_grads_with_norm_. Ratios > 1 mean threadpar is faster.
"""

from __future__ import annotations

import torch

import threadpar
from benchmarks.harness import (
    EVERY_CORE,
    fmt_time,
    machine_line,
    median_time,
    repeats_of,
    repeats_parser,
    run_gloo,
    table,
)

HIDDEN, LAYERS, ITERS = 1024, 4, 20


def shard_params(tp_rank: int, tp: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(sharded weights, replicated biases) with gradients, as rank tp_rank of tp holds them."""
    g = torch.Generator().manual_seed(tp_rank)
    weights, biases = [], []
    for _ in range(LAYERS):
        w = torch.nn.Parameter(torch.empty(HIDDEN // tp, HIDDEN))
        w.grad = torch.randn(HIDDEN // tp, HIDDEN, generator=g)
        b = torch.nn.Parameter(torch.empty(HIDDEN))
        b.grad = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(99))
        weights.append(w)
        biases.append(b)
    return weights, biases


def gloo_worker(rank: int, tp: int, repeats: int) -> float:
    import torch.distributed as dist

    weights, biases = shard_params(rank, tp)
    params = weights + biases
    counted = [p.grad for p in weights] + ([p.grad for p in biases] if rank == 0 else [])

    def clip():
        local = torch.nn.utils.get_total_norm(counted, 2.0)
        squared = local.square()
        dist.all_reduce(squared)
        torch.nn.utils.clip_grads_with_norm_(params, 1e9, squared.sqrt())

    clip()
    return median_time(clip, iters=ITERS, repeats=repeats, sync=dist.barrier)


def threads_worker(repeats: int) -> float:
    from threadpar.parallel import GradPlacement, clip_grad_norm_, mark_grad_placement

    tp = threadpar.get_group("TP")
    weights, biases = shard_params(tp.rank(), tp.size())
    for w in weights:
        mark_grad_placement(w, GradPlacement())  # a distinct piece on every TP rank
    for b in biases:
        mark_grad_placement(b, GradPlacement(replicated_over=(tp,)))  # the same on every TP rank
    params = weights + biases

    def clip():
        clip_grad_norm_(params, 1e9)

    clip()
    return median_time(clip, iters=ITERS, repeats=repeats, sync=threadpar.barrier)


def dense_clip(repeats: int) -> float:
    weights, biases = shard_params(0, 1)
    params = weights + biases
    return median_time(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), iters=ITERS, repeats=repeats)


def main() -> None:
    parser = repeats_parser(__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    repeats = repeats_of(args)
    print(f"# clip_grad_norm_ of a 16 MiB MLP's gradients split over TP ({machine_line()})")
    print(f"# median of {repeats} repeats of {ITERS} clips\n")
    dense = dense_clip(repeats)
    rows = [["dense model, one thread (torch)", 1, fmt_time(dense), "", ""]]
    for tp in args.tp:
        ours = threadpar.launch(
            threads_worker, repeats, world_size=tp, tp=tp, devices="cpu", rank_cores=EVERY_CORE
        )[0]
        gloo = run_gloo(gloo_worker, tp, repeats)
        rows.append(
            [f"tp={tp}: gloo by hand vs threadpar", tp, fmt_time(gloo), fmt_time(ours), f"{gloo / ours:.2f}x"]
        )
    print(table(["case", "ranks", "anchor", "threadpar", "speed-up"], rows))


if __name__ == "__main__":
    main()
