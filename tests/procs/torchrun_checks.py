"""Every collective and point-to-point path across processes, under torchrun (driven by test_multiprocess.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/procs/torchrun_checks.py

Each process runs 2 rank threads. First launch (tp=2): every collective and message, on the world and DP
groups (spanning both processes) and TP groups (inside one). Second launch (pp=2): pipelines whose stages
sit in different processes, against the whole model trained in one thread. Then two launches of
DistributedDataParallel over all 4 ranks (dp=4) against one thread on the concatenated batch; then
torch.distributed in the rank threads across the processes, and this thread's gloo group unchanged after.
One "OK" line per check and process.
"""

import time

from checks import check_ddp, check_pipeline, run_all

import threadpar


def main() -> None:
    env = threadpar.process_env()
    threads = 2
    start = time.perf_counter()
    counts = threadpar.launch(
        run_all, env.count, threads, threads_per_process=threads, tp=2, devices="cpu", timeout=60
    )
    took = time.perf_counter() - start
    print(f"process {env.rank}: collectives OK ({sum(counts)} checks on {threads} threads, {took:.1f} s)")
    start = time.perf_counter()
    counts = threadpar.launch(check_pipeline, threads_per_process=threads, pp=2, devices="cpu", timeout=60)
    took = time.perf_counter() - start
    print(f"process {env.rank}: pipeline OK ({sum(counts)} parameters match, {took:.1f} s)")
    start = time.perf_counter()
    count = check_ddp(
        lambda body, world: threadpar.launch(body, threads_per_process=threads, devices="cpu", timeout=60),
        env.count * threads,
    )
    took = time.perf_counter() - start
    print(f"process {env.rank}: DDP OK ({count} gradients and parameters match, {took:.1f} s)")
    check_torch_distributed(env.rank, threads)


def check_torch_distributed(process: int, threads: int) -> None:
    """torch.distributed in the rank threads spans the processes (4 ranks); afterwards this thread's own
    torch.distributed (the gloo group threadpar's processes hold) is as it was."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    before = dist.group.WORLD

    def body() -> float:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    sums = threadpar.launch(body, threads_per_process=threads, devices="cpu", timeout=60)
    assert sums == [6.0] * threads, sums
    assert dist.group.WORLD is before and dist.get_backend() == "gloo" and dist.get_world_size() == 2
    t = torch.ones(1)
    dist.all_reduce(t)
    u = funcol.wait_tensor(funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD))
    assert t.item() == 2.0 and u.item() == 2.0, (t, u)
    print(f"process {process}: torch.distributed OK (ranks and the caller's gloo group)")


if __name__ == "__main__":
    main()
