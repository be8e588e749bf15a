"""Context parallelism: causal ring attention over CP rank threads vs full attention on one thread.

    python -m benchmarks.cp                 # batch 1 x 8 heads x seq 4096 x head_dim 64, cp = 2
    python -m benchmarks.cp --quick         # seq 2048, fewer repeats

Forward + backward of causal attention, fp32 on CPU. The anchor is F.scaled_dot_product_attention on the
whole sequence on one thread (PyTorch's fused CPU flash kernel); ring attention splits the sequence over
cp rank threads (load-balanced: chunks r and 2cp-1-r) with one intra-op thread each, and uses the same
fused kernel per block (kernel="flash"). Each round times the anchor (on rank 0, the other ranks wait)
and ring attention one after the other, so load from outside hits both alike; times are medians over
rounds. "CPU time/rank" is the step's CPU time on the rank's own thread: on a shared machine it shows
the split of the work that wall-clock times can hide.

Bytes: the CP group handle's isend is wrapped to record every message, next to the ring's theoretical
volume per rank and step, with |kv| = the bytes of one rank's k and v (2 * batch * heads * seq/cp * dim
* 4): forward (cp-1) * |kv|; backward (cp-1) * |kv| (k/v around again) + (cp-1) * |dkv| (partial sums).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import threadpar
from benchmarks.harness import EVERY_CORE, fmt_bytes, fmt_time, machine_line, median_time, table
from threadpar.parallel import restore_sequence_order, ring_attention, split_sequence


class SendCounter:
    """Wraps one ProcessGroup handle's isend (the one ring attention captured) to record (phase, bytes)."""

    def __init__(self, group) -> None:
        self.phase: str | None = None
        self.sent: list[tuple[str, int]] = []
        isend = group.isend

        def counted(tensor, dst, tag=0):
            if self.phase is not None:
                self.sent.append((self.phase, tensor.numel() * tensor.element_size()))
            return isend(tensor, dst, tag)

        group.isend = counted


def step(fn, inputs, grad_out) -> torch.Tensor:
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(grad_out)
    return out


def full(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rank_main(q, k, v, grad_out, iters: int, repeats: int):
    group = threadpar.get_group("CP")
    rank = group.rank()
    counter = SendCounter(group)
    local = [split_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
    local_grad = split_sequence(grad_out, dim=2)
    cases = {"ring": (ring_attention, local, local_grad)}
    if rank == 0:
        cases["full"] = (full, [t.clone().requires_grad_() for t in (q, k, v)], grad_out)

    counter.phase = "fwd"  # one untimed step: the messages it sends, and a warm-up
    out = ring_attention(*local)
    counter.phase = "bwd"
    out.backward(local_grad)
    counter.phase = None
    result = {"out": out.detach(), "dq": local[0].grad, "sent": counter.sent}

    samples = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    for round_ in range(repeats + 1):  # round 0 warms up the anchor
        for name in ("full", "ring"):
            group.barrier()
            if name not in cases:
                continue
            fn, inputs, g = cases[name]
            start_cpu = time.thread_time()
            seconds = median_time(lambda f=fn, i=inputs, g=g: step(f, i, g), iters=iters, repeats=1)
            if round_:
                samples[name].append(seconds)
                cpu[name].append((time.thread_time() - start_cpu) / iters)
    result.update({name: statistics.median(s) for name, s in samples.items()})
    result.update({f"{name}_cpu": statistics.median(s) for name, s in cpu.items()})
    return result


def full_wide(q, k, v, grad_out, iters: int, repeats: int) -> float:
    """The anchor again with as many intra-op threads as all CP ranks together (the same cores)."""
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    step(full, inputs, grad_out)
    return median_time(lambda: step(full, inputs, grad_out), iters=iters, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="seq 2048, 3 repeats")
    args = parser.parse_args()
    seq, repeats = (2048, 3) if args.quick else (args.seq, args.repeats)
    cp, iters = args.cp, args.iters
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=g) for _ in range(4))

    print(f"# context parallelism: causal attention fwd+bwd, batch {args.batch} x {args.heads} heads x seq {seq} x "
          f"head_dim {args.head_dim}, fp32, cp = {cp}, 1 intra-op thread per rank ({machine_line()})")  # fmt: skip
    print(
        f"# median of {repeats} rounds of {iters} step(s); each round times full attention (rank 0) then ring\n"
    )
    per_rank = threadpar.launch(
        rank_main,
        q,
        k,
        v,
        grad_out,
        iters,
        repeats,
        world_size=cp,
        cp=cp,
        devices="cpu",
        intraop_threads=1,
        rank_cores=EVERY_CORE,
    )
    wide = threadpar.launch(
        full_wide, q, k, v, grad_out, iters, repeats, world_size=1, devices="cpu", intraop_threads=cp
    )[0]

    # the timed code computes full attention: check the reassembled output and dq
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out = step(full, want, grad_out)
    for key, ref in (("out", want_out.detach()), ("dq", want[0].grad)):
        got = restore_sequence_order(torch.cat([r[key] for r in per_rank], dim=2), cp, dim=2)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    base, base_cpu = per_rank[0]["full"], per_rank[0]["full_cpu"]
    ring = max(r["ring"] for r in per_rank)  # a step ends when the slowest rank is done
    ring_cpu = max(r["ring_cpu"] for r in per_rank)
    rows = [
        ["full attention, 1 thread (anchor)", fmt_time(base), "1.00x", f"{fmt_time(base_cpu)} (1.00x)"],
        [f"full attention, {cp} threads", fmt_time(wide), f"{base / wide:.2f}x", "-"],
        [f"ring attention, cp={cp} x 1 thread", fmt_time(ring), f"{base / ring:.2f}x",
         f"{fmt_time(ring_cpu)} ({base_cpu / ring_cpu:.2f}x)"],
    ]  # fmt: skip
    print(table(["attention", "fwd+bwd", "speed-up vs anchor", "CPU time/rank (speed-up)"], rows))

    kv = 2 * args.batch * args.heads * (seq // cp) * args.head_dim * 4
    theory = {"fwd": (cp - 1) * kv, "bwd": 2 * (cp - 1) * kv}
    print(f"\n# bytes sent per rank per attention call (|kv| = {fmt_bytes(kv)})\n")
    rows = []
    for phase in ("fwd", "bwd"):
        sent = [sum(b for p, b in r["sent"] if p == phase) for r in per_rank]
        if len(set(sent)) != 1:
            raise RuntimeError(f"the CP ranks sent different volumes in {phase}: {sent}")
        messages = sum(1 for p, _ in per_rank[0]["sent"] if p == phase)
        rows.append(
            [phase, messages, fmt_bytes(sent[0]), fmt_bytes(theory[phase]), f"{sent[0] / theory[phase]:.2f}"]
        )
    print(table(["phase", "messages/rank", "sent/rank", "theory (ring)", "ratio"], rows))


if __name__ == "__main__":
    main()
