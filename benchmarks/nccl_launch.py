"""Host cost of one collective on the nccl backend, measured without a GPU.

    python -m benchmarks.nccl_launch            # 2, 4 and 8 ranks
    python -m benchmarks.nccl_launch --quick

On GPUs a small NCCL all-reduce takes the device some 10-30 us. What threadpar adds on the host is Python
work serialized by the GIL across the rank threads: the argument checks, the call's entry in the ledger
(the mismatch check without a meeting), the device lock, the NCCL call, for an asynchronous op its events
and Work. Each rank thread calls NCCL itself, so no rank waits for another: this measures that cost per
collective with a *null* CUDA API (streams, events and NCCL calls that do nothing), so the numbers are
threadpar's own overhead with n rank threads issuing at once, a lower bound of the real host time (the
real ncclAllReduce through ctypes adds ~5 us: benchmarks/nccl_host_cost.py).

Side by side in one run, on 4-byte all-reduces: n plain Python threads meeting at a `threading.Barrier`
(the floor of any design in which the members of a collective meet on the host; issue 32 asks for at most
0.5 round trips of it per collective), the nccl path (synchronous calls back to back, and 10 asynchronous
ones issued and then waited), the threads backend (its whole cost on CPU: a meeting per collective), and
torch.distributed over gloo with one process per rank (the anchor of benchmarks/collectives.py). Also: how
many all-reduces rank 0 issues while every other rank is held before its first (they never meet), and
what the mismatch check (every member's call left in the group's CallLedger) costs of a collective.
The Barrier and threadpar's paths run twice: unpinned, and with all their threads on one core
(`LaunchConfig.rank_cores=1`, the default for CPU ranks); the ratios compare the nccl path with the
unpinned Barrier (the issue's anchor) and with a Barrier whose threads share the same one core.
Wall times on a shared machine are noisy, so the CPU time per collective is reported too: the process's
CPU time for threadpar (all rank threads), and n times one rank's process for gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import threading
import time

import torch

import threadpar
from benchmarks.harness import fmt_time, machine_line, median_time, run_gloo, table
from threadpar.comm.common.call_ledger import CallLedger
from threadpar.comm.common.rendezvous import Call
from threadpar.comm.nccl.resources import CliquePool, CommStreams, DeviceLocks
from threadpar.comm.nccl.watchdog import Watchdog
from threadpar.runtime.launch import _Launch
from threadpar.runtime.rank_cores import allowed_cpus, choose_rank_cpus, pin_calling_thread
from threadpar.runtime.world import World
from threadpar.topology import Layout

ASYNC_BATCH = 10


class NullStream:
    def wait_event(self, event) -> None:
        pass


class NullEvent:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class NullNccl:
    """NCCL's C API (threadpar's NcclApi); every call returns at once."""

    def version(self):
        return (2, 21, 5)

    def get_unique_id(self) -> bytes:
        return b"null"

    def comm_init_rank(self, nranks, unique_id, rank, device):
        return object()

    def comm_init_rank_config(self, nranks, unique_id, rank, device, blocking):
        return object()

    def comm_get_async_error(self, comm) -> int:
        return 0

    def group_end(self) -> int:
        return 0

    def _nothing(self, *args) -> None:
        pass

    group_start = all_reduce = reduce = broadcast = all_gather = reduce_scatter = _nothing
    comm_abort = comm_destroy = send = recv = _nothing


class NullCuda:
    """A CudaApi and NcclRuntime whose device and library do nothing: what remains is threadpar's own host
    work."""

    def __init__(self) -> None:
        self.nccl = NullNccl()
        self.device_locks = DeviceLocks()
        self.cliques = CliquePool()
        self.streams = CommStreams()
        self.watchdog = Watchdog()
        self._stream = NullStream()

    @property
    def cuda(self) -> NullCuda:  # the NcclRuntime's CUDA primitives: itself
        return self

    def nccl_available(self) -> bool:
        return True

    def prepare_environment(self) -> None:
        pass

    def pool_stream(self, device, priority):
        return NullStream()

    def current_stream(self, device):
        return self._stream

    def event(self):
        return NullEvent()

    def on_streams(self, *streams):
        return contextlib.nullcontext()

    def device_guard(self, device):
        return contextlib.nullcontext()

    def copy_(self, dst, src, src_stream, dst_stream) -> None:
        pass

    def record_stream(self, tensor, stream) -> None:
        pass

    def synchronize(self, device) -> None:
        pass


def run_null(fn, n: int, cpus: frozenset[int] | None):
    """`fn` on n rank threads of the nccl backend over the null device (`cpus`: where they run)."""
    gc.collect()  # (not the first full collection after torch's import, ~0.2 s, inside a timed repeat)
    world = World(
        layout=Layout.build(n),
        backend="nccl",
        devices=(torch.device("cpu"),) * n,
        timeout=60.0,
        seed=0,
        intraop_threads=1,
        cuda=NullCuda(),
        rank_cpus=cpus,
    )
    return _Launch(world, fn, (), {}).run()


def ahead(n: int, calls: int) -> int:
    """How many all-reduces rank 0 issues while every other rank is held before its first one."""
    issued = threading.Event()

    def body() -> int:
        t = torch.ones(1)
        threadpar.all_reduce(t)  # the communicators
        if threadpar.get_rank() != 0:
            issued.wait(60)
            for _ in range(calls):
                threadpar.all_reduce(t)
            return 0
        count = 0
        for _ in range(calls):
            threadpar.all_reduce(t)
            count += 1
        issued.set()
        return count

    return run_null(body, n, None)[0]


def measure(api, iters: int, repeats: int, barrier) -> list[float]:
    """Seconds per all-reduce: [synchronous, issued asynchronously in batches, CPU time of this process
    (synchronous)]; `barrier` starts every repeat of every rank together and ends it once every rank has
    made its calls: the time per collective is that of all ranks issuing it. (Without the closing barrier a
    rank of the nccl path, which waits for no peer, would time its own calls alone: under one GIL a rank
    runs thousands of calls while the others wait for the GIL.)"""
    t = torch.ones(1)

    def batch() -> None:
        for work in [api.all_reduce(t, async_op=True) for _ in range(ASYNC_BATCH)]:
            work.wait()

    for _ in range(3):
        api.all_reduce(t)  # warm-up (and, on the nccl path, the communicators)
    waited = median_time(
        lambda: api.all_reduce(t), iters=iters, repeats=repeats, sync=barrier, finish=barrier
    )
    batched = median_time(
        batch, iters=max(1, iters // ASYNC_BATCH), repeats=repeats, sync=barrier, finish=barrier
    )
    cpu = median_time(
        lambda: api.all_reduce(t),
        iters=iters,
        repeats=repeats,
        sync=barrier,
        finish=barrier,
        clock=time.process_time,
    )
    return [waited, batched / ASYNC_BATCH, cpu]


def barrier_meeting(n: int, iters: int, repeats: int, cpus: frozenset[int] | None = None) -> float:
    """Seconds per meeting of n plain Python threads at a threading.Barrier: the floor of any design in
    which every member of a collective waits for the others on the host (the issue's anchor). `cpus`: the
    cores the threads run on (None: where the OS puts them)."""
    barrier = threading.Barrier(n)
    times: list[float] = []
    gc.collect()

    def member(i: int) -> None:
        pin_calling_thread(cpus)
        for _ in range(3):
            barrier.wait()
        t = median_time(barrier.wait, iters=iters, repeats=repeats, sync=barrier.wait, finish=barrier.wait)
        if i == 0:
            times.append(t)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times[0]


def ledger_check(n: int, iters: int, repeats: int) -> float:
    """Seconds per collective of the mismatch check alone (rule 6 without a meeting): the n members' entries
    of each call in one CallLedger, made by one thread (under one GIL the rank threads' entries run one
    after another anyway; this leaves out their thread switches); median of `repeats`."""
    call = Call("all_reduce", torch.float32, (1,), (("op", "sum"),))
    times = []
    for _ in range(repeats):
        ledger = CallLedger("bench", range(n))
        began = time.perf_counter()
        for seq in range(iters):
            for m in range(n):
                ledger.enter(m, seq, call)
        times.append((time.perf_counter() - began) / iters)
    return statistics.median(times)


def gloo_worker(rank: int, n: int, iters: int, repeats: int) -> list[float]:
    import torch.distributed as dist

    return measure(dist, iters, repeats, dist.barrier)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="3 repeats of 100")
    parser.add_argument("--no-gloo", action="store_true", help="leave out the gloo processes (slow to start)")
    parser.add_argument("--rounds", type=int, default=5, help="Barrier / nccl path alternations")
    args = parser.parse_args()
    repeats, iters = (3, 100) if args.quick else (args.repeats, args.iters)
    print(
        f"# host time per 4-byte all-reduce ({machine_line()}); median of {repeats} repeats of {iters}; "
        f"Barrier and nccl path: median of {args.rounds} alternating rounds (ratio: the rounds' median)\n"
    )
    one_core = choose_rank_cpus(
        1, on_cpu=True, threads=2, local_index=0, local_count=1, allowed=allowed_cpus()
    )
    placements = {"unpinned": (None, "all"), "one core": (one_core, 1)}
    rows = []
    for n in args.ranks:
        work = lambda: measure(threadpar, iters, repeats, threadpar.barrier)  # noqa: E731
        # The Barrier and the nccl path alternate, round after round, in both placements: each ratio is
        # the median of the rounds' ratios. The issue's anchor is the unpinned Barrier.
        meetings: dict[str, list[float]] = {p: [] for p in placements}
        paths: dict[str, list[list[float]]] = {p: [] for p in placements}
        for _ in range(args.rounds):
            for name, (cpus, _) in placements.items():
                meetings[name].append(barrier_meeting(n, iters, repeats, cpus))
                start = threading.Barrier(n)  # (the null device's barrier() does not meet: a Python one)
                null_work = lambda start=start: measure(threadpar, iters, repeats, start.wait)  # noqa: E731
                paths[name].append(run_null(null_work, n, cpus)[0])
        gloo = [float("nan")] * 3 if args.no_gloo else run_gloo(gloo_worker, n, iters, repeats)
        gloo_cpu = gloo[2] * n  # one process per rank
        check = ledger_check(n, iters, repeats)
        for name, (_, rank_cores) in placements.items():
            nccl_path = [statistics.median(p[i] for p in paths[name]) for i in range(3)]

            def ratios(anchor: list[float], runs: list[list[float]] = paths[name]) -> str:
                waited = statistics.median(p[0] / m for p, m in zip(runs, anchor))
                issued = statistics.median(p[1] / m for p, m in zip(runs, anchor))
                return f"{waited:.2f}x / {issued:.2f}x"

            threads = threadpar.launch(
                work, world_size=n, devices="cpu", backend="threads", rank_cores=rank_cores
            )[0]
            rows.append(
                [
                    n,
                    name,
                    f"{ahead(n, 100)} of 100",
                    fmt_time(statistics.median(meetings["unpinned"])),
                    fmt_time(statistics.median(meetings[name])),
                    *(fmt_time(t) for t in (nccl_path[0], nccl_path[1])),
                    ratios(meetings["unpinned"]),
                    ratios(meetings[name]),
                    *(fmt_time(t) for t in (threads[0], threads[1], gloo[0])),
                    f"{gloo[0] / nccl_path[0]:.1f}x",
                    *(fmt_time(t) for t in (nccl_path[2], threads[2], gloo_cpu)),
                    f"{gloo_cpu / nccl_path[2]:.1f}x",
                    fmt_time(check),
                ]
            )
    headers = [
        "ranks",
        "rank threads on",
        "rank 0 issues, the others held",
        "Barrier, unpinned",
        "Barrier, same cores",
        "nccl path, synchronous",
        f"nccl path, async x{ASYNC_BATCH}",
        "nccl path / unpinned Barrier (sync / async)",
        "nccl path / Barrier on the same cores",
        "threads, waited",
        f"threads, async x{ASYNC_BATCH}",
        "gloo, waited",
        "gloo / nccl path",
        "CPU: nccl path",
        "CPU: threads",
        "CPU: gloo",
        "gloo / nccl path (CPU)",
        "of which the mismatch check",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
