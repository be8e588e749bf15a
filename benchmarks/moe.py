"""Expert parallelism: the MoE layer's all-to-all dispatch bytes vs theory, and its time vs one thread.

    python -m benchmarks.moe              # 8 experts, top-2, hidden 512, ffn 1024, 4096 tokens/rank, ep = 2
    python -m benchmarks.moe --quick      # 1024 tokens per rank, fewer repeats

Each EP rank routes its own batch of tokens; the layer sends every kept assignment's row to the rank of
its expert and back. The EP group handle's all_to_all_single is wrapped to record what each call sends
to the *other* ranks (rows to itself are not communication), split into the token exchanges (dispatch
and combine in forward, their conjugates in backward) and the per-expert count exchange. Theory, per
rank and direction, with h = hidden * 4 bytes:
  - exact: the rows this rank routes (and keeps) to experts on other ranks, times h, from its routing;
  - uniform routing: tokens * top_k * (ep - 1) / ep * h (less any dropped assignments);
  - a capacity-padded dispatcher (GShard-style fixed [E, capacity] buffers): E * capacity * (ep - 1) / ep * h,
    where dropless needs capacity = the largest count of any expert on any rank.
Time: MoE forward + backward on ep rank threads (one intra-op thread each, each its own batch) vs the
single-thread MoE with all experts running the ep batches one after another (the anchor), rounds
interleaved, medians reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_bytes, fmt_time, machine_line, median_time, table
from threadpar.parallel import MoE, MoEConfig
from threadpar.parallel.expert_parallel.routing import expert_capacity


class AllToAllCounter:
    """Wraps one ProcessGroup handle's all_to_all_single to record (phase, kind, bytes sent to other ranks)."""

    def __init__(self, group) -> None:
        self.phase: str | None = None
        self.calls: list[tuple[str, str, int]] = []
        me, size, exchange = group.rank(), group.size(), group.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, async_op=False):
            if self.phase is not None:
                rows = list(input_split_sizes or [input.shape[0] // size] * size)
                row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
                kind = "counts" if input.dtype == torch.int64 else "tokens"
                self.calls.append((self.phase, kind, (sum(rows) - rows[me]) * row_bytes))
            return exchange(output, input, output_split_sizes, input_split_sizes, async_op)

        group.all_to_all_single = counted


def step(model, x, grad_out) -> None:
    model.zero_grad(set_to_none=True)
    model(x).backward(grad_out)


def rank_main(cfg: MoEConfig, state, batches, grads, iters: int, repeats: int):
    group = threadpar.get_group("DP")
    rank = group.rank()
    model = MoE(cfg)  # EP group = this rank's DP group
    model.load_state_dict(state)
    counter = AllToAllCounter(group)
    x, g = batches[rank], grads[rank]  # x requires grad, as inside a model
    counter.phase = "fwd"
    y = model(x)
    counter.phase = "bwd"
    y.backward(g)
    counter.phase = None
    stats = model.last_stats
    result = {"calls": counter.calls, "kept": stats.kept, "dropped": stats.dropped}
    anchor = None
    if rank == 0:  # the single-thread MoE with all experts, every rank's batch in turn
        anchor = MoE(cfg, group=threadpar.new_group([threadpar.get_rank()]))
        anchor.load_state_dict(state)
    samples, cpu = {"ep": [], "single": []}, {"ep": [], "single": []}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name in ("single", "ep"):
            group.barrier()
            if name == "single" and anchor is None:
                continue
            run = (lambda: [step(anchor, b, gr) for b, gr in zip(batches, grads)]) if name == "single" else (
                lambda: step(model, x, g)
            )  # fmt: skip
            start = time.thread_time()
            seconds = median_time(run, iters=iters, repeats=1)
            if round_:
                samples[name].append(seconds)
                cpu[name].append((time.thread_time() - start) / iters)
    for name in ("ep", "single"):
        if samples[name]:
            result[name] = statistics.median(samples[name])
            result[f"{name}_cpu"] = statistics.median(cpu[name])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1024 tokens per rank, 3 repeats")
    args = parser.parse_args()
    tokens, repeats = (1024, 3) if args.quick else (args.tokens, args.repeats)
    ep, h_bytes = args.ep, args.hidden * 4
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(tokens, args.hidden, generator=g).requires_grad_() for _ in range(ep)]
    grads = [torch.randn(tokens, args.hidden, generator=g) for _ in range(ep)]

    print(f"# expert parallelism: MoE {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, ffn {args.ffn}, "
          f"{tokens} tokens per rank, fp32, ep = {ep}, 1 intra-op thread per rank ({machine_line()})")  # fmt: skip
    print(
        f"# fwd+bwd: median of {repeats} rounds; each round times the single-thread MoE on all {ep} batches, "
        "then the EP ranks\n"
    )
    bytes_rows, time_rows = [], []
    for capacity_factor in (None, 1.0):
        cfg = MoEConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts,
                        top_k=args.top_k, capacity_factor=capacity_factor)  # fmt: skip
        state = MoE(cfg, generator=torch.Generator().manual_seed(1)).state_dict()
        per_rank = threadpar.launch(
            rank_main, cfg, state, batches, grads, args.iters, repeats,
            world_size=ep, devices="cpu", intraop_threads=1,
            rank_cores=EVERY_CORE,
        )  # fmt: skip
        label = "dropless" if capacity_factor is None else f"capacity factor {capacity_factor}"
        # a padded dispatcher's buffers hold `capacity` rows per expert; dropless, the largest count anywhere
        capacity = expert_capacity(tokens, args.top_k, args.experts, capacity_factor) or max(
            int(r["kept"].max()) for r in per_rank
        )
        owner = torch.arange(args.experts) // (args.experts // ep)  # the EP rank of each expert
        for rank, r in enumerate(per_rank):
            calls = {
                phase: [b for p, k, b in r["calls"] if p == phase and k == "tokens"]
                for phase in ("fwd", "bwd")
            }
            counts = sum(b for p, k, b in r["calls"] if k == "counts")
            dispatch, combine = calls["fwd"]
            # backward: the combine's conjugate carries the dispatch's volume, then the dispatch's the combine's
            if calls["bwd"] != [dispatch, combine]:
                raise RuntimeError(f"backward should send what forward sent, in reverse: {calls}")
            # exact: the rows it routes to other ranks' experts; those other ranks route to its experts
            exact_dispatch = int(r["kept"][owner != rank].sum()) * h_bytes
            exact_combine = sum(int(o["kept"][owner == rank].sum()) for o in per_rank if o is not r) * h_bytes
            uniform = (tokens * args.top_k - r["dropped"]) * (ep - 1) / ep * h_bytes
            padded = args.experts * capacity * (ep - 1) / ep * h_bytes
            bytes_rows.append([
                label, rank, fmt_bytes(dispatch), f"{dispatch / exact_dispatch:.2f}", f"{dispatch / uniform:.2f}",
                f"{dispatch / padded:.2f}", fmt_bytes(combine), f"{combine / exact_combine:.2f}",
                fmt_bytes(sum(calls["bwd"])), fmt_bytes(counts),
            ])  # fmt: skip
        single, single_cpu = per_rank[0]["single"], per_rank[0]["single_cpu"]
        ep_time = max(r["ep"] for r in per_rank)
        ep_cpu = max(r["ep_cpu"] for r in per_rank)
        time_rows.append([label, f"single thread, all experts, {ep} batches (anchor)", fmt_time(single), "1.00x",
                          f"{fmt_time(single_cpu)} (1.00x)"])  # fmt: skip
        time_rows.append([label, f"ep={ep} x 1 thread, one batch each", fmt_time(ep_time), f"{single / ep_time:.2f}x",
                          f"{fmt_time(ep_cpu)} ({single_cpu / ep_cpu:.2f}x)"])  # fmt: skip

    print(table(["routing", "MoE", "fwd+bwd", "speed-up", "CPU time/rank (speed-up)"], time_rows))
    print("\n# bytes each rank sends to the other ranks per MoE call (rows to itself are not counted)\n")
    headers = ["routing", "rank", "dispatch (fwd)", "/ exact", "/ uniform", "/ padded", "combine (fwd)",
               "/ exact", "backward (both)", "counts (fwd)"]  # fmt: skip
    print(table(headers, bytes_rows))


if __name__ == "__main__":
    main()
