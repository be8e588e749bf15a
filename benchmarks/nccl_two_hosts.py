"""Can one GPU hold a 2-rank NCCL communicator across two processes? NCCL refuses two ranks of a communicator
on one GPU ("Duplicate GPU detected", src/init.cc), detected by host hash and bus id; two processes that each
claim a host of their own (a different NCCL_HOSTID each, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, so they connect
over sockets) form one (measured on an H100: they do). So the cross-process path can be tested for real on a
one-GPU machine. This script does it twice:
1. through threadpar's binding alone: ncclCommInitRank with the id passed in a file, every collective and a
   send/recv pair checked against the expected values, then process 1 exits without its part of an
   all-reduce and process 0 reports whether ncclCommAbort ends the waiting kernel;
2. through threadpar itself: two processes (torch.distributed's environment, as torchrun sets it) of one
   rank thread each, on the same GPU, run every collective and point to point of the nccl backend's spanning
   groups (each rank thread's own NCCL calls, communicators through the store, pair communicators for
   send/recv), checked against the expected values; then a launch in which rank 1 fails while rank 0 waits
   on the device for a collective rank 1 never issues: both processes must stop, naming rank 1 (the
   watchdog aborts the communicator that holds rank 0's kernel).

    python -m benchmarks.nccl_two_hosts      # prints one line per check; exit 0 when all passed
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TIMEOUT_S = 45


def member(rank: int, folder: Path) -> None:
    from threadpar.comm.nccl.library import SUM, nccl_group, nccl_library

    lib = nccl_library()
    id_file = folder / "unique_id"
    if rank == 0:
        id_file.with_suffix(".tmp").write_bytes(lib.get_unique_id())
        id_file.with_suffix(".tmp").rename(id_file)
    deadline = time.monotonic() + 30
    while not id_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no unique id from process 0")
        time.sleep(0.05)
    torch.cuda.set_device(0)
    comm = lib.comm_init_rank(2, id_file.read_bytes(), rank, 0)
    stream = torch.cuda.current_stream()
    x = torch.full((4,), float(rank + 1), device="cuda")
    lib.all_reduce(x, x, SUM, comm, stream)
    b = torch.full((4,), float(rank), device="cuda")
    lib.broadcast(b, b, 1, comm, stream)
    gathered = torch.empty(8, device="cuda")
    lib.all_gather(torch.full((4,), float(rank), device="cuda"), gathered, comm, stream)
    scattered = torch.empty(2, device="cuda")
    lib.reduce_scatter(torch.arange(4.0, device="cuda"), scattered, SUM, comm, stream)
    got = torch.empty(3, device="cuda")
    with nccl_group(lib):
        lib.send(torch.full((3,), 10.0 + rank, device="cuda"), 1 - rank, comm, stream)
        lib.recv(got, 1 - rank, comm, stream)
    torch.cuda.synchronize()
    checks = {
        "all_reduce": x.eq(3).all(),
        "broadcast root 1": b.eq(1).all(),
        "all_gather": torch.equal(gathered.cpu(), torch.tensor([0.0] * 4 + [1.0] * 4)),
        "reduce_scatter": torch.equal(scattered.cpu(), 2 * torch.arange(4.0)[2 * rank : 2 * rank + 2]),
        "send/recv": got.eq(11.0 - rank).all(),
    }
    for name, ok in checks.items():
        print(f"process {rank}: {name}: {'pass' if ok else 'FAIL'}", flush=True)
    if rank == 1:
        os._exit(0)  # dies without its part of the next all-reduce
    lonely = torch.ones(1, device="cuda")
    lib.all_reduce(lonely, lonely, SUM, comm, stream)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(2.0)
    print(
        f"process 0: all_reduce without its peer done after 2 s: {done.query()} (expected False)", flush=True
    )
    start = time.perf_counter()
    lib.comm_abort(comm)
    torch.cuda.synchronize()
    print(
        f"process 0: ncclCommAbort ended the waiting kernel in {time.perf_counter() - start:.2f} s: pass",
        flush=True,
    )


def spanning_checks() -> dict[str, bool]:
    """Every collective and point to point of the nccl backend between the two processes' rank threads."""
    import threadpar

    rank, device = threadpar.get_rank(), threadpar.get_device()
    full = lambda value, n=4: torch.full((n,), float(value), device=device)  # noqa: E731
    x = full(rank + 1)
    threadpar.all_reduce(x)
    b = full(rank)
    threadpar.broadcast(b, src=1)
    gathered = torch.empty(8, device=device)
    threadpar.all_gather_into_tensor(gathered, full(rank))
    scattered = torch.empty(2, device=device)
    threadpar.reduce_scatter_tensor(scattered, torch.arange(4.0, device=device))
    chunk = torch.empty(2, device=device)
    threadpar.scatter(chunk, [full(10, 2), full(11, 2)] if rank == 0 else None, src=0)
    outs = [torch.empty(2, device=device) for _ in range(2)] if rank == 1 else None
    threadpar.gather(full(20 + rank, 2), outs, dst=1)
    a2a = [torch.empty(1, device=device) for _ in range(2)]
    threadpar.all_to_all(a2a, [full(30 + 2 * rank + m, 1) for m in range(2)])
    work = threadpar.isend(full(40 + rank, 3), dst=1 - rank)  # (both send first: buffered, no deadlock)
    got = threadpar.get_group().recv_tensor(1 - rank)
    work.wait()
    threadpar.barrier()
    checks = {
        "all_reduce": x.eq(3).all(),
        "broadcast root 1": b.eq(1).all(),
        "all_gather": torch.equal(gathered.cpu(), torch.tensor([0.0] * 4 + [1.0] * 4)),
        "reduce_scatter": torch.equal(scattered.cpu(), 2 * torch.arange(4.0)[2 * rank : 2 * rank + 2]),
        "scatter": chunk.eq(10 + rank).all(),
        "gather": rank == 0 or all(o.eq(20 + i).all() for i, o in enumerate(outs or [])),
        "all_to_all": [t.item() for t in a2a] == [30.0 + rank, 32.0 + rank],
        "send/recv both ways at once": got.eq(41 - rank).all(),
    }
    return {name: bool(ok) for name, ok in checks.items()}


def stopped() -> None:
    """Rank 1 fails while rank 0 waits on the device for a collective rank 1 never issues."""
    import threadpar

    threadpar.all_reduce(torch.ones(1, device=threadpar.get_device()))  # communicators made
    if threadpar.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    t = torch.ones(1, device=threadpar.get_device())
    threadpar.all_reduce(t)
    t.item()  # the host waits on the device until the watchdog aborts the communicator


def threadpar_member(rank: int, port: int) -> None:
    import threadpar

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = dict(threads_per_process=1, backend="nccl", devices=["cuda:0"], timeout=20)
    (checks,) = threadpar.launch(spanning_checks, **options)
    for name, ok in checks.items():
        print(f"process {rank} (threadpar): {name}: {'pass' if ok else 'FAIL'}", flush=True)
    start = time.perf_counter()
    try:
        threadpar.launch(stopped, **options)
        print(f"process {rank} (threadpar): a failed launch stopped: FAIL (it returned)", flush=True)
    except threadpar.RankFailedError as error:
        named = error.rank == 1 and "rank 1 fails on purpose" in str(error)
        print(
            f"process {rank} (threadpar): a failed launch stopped in {time.perf_counter() - start:.2f} s naming "
            f"rank 1: {'pass' if named else 'FAIL: ' + str(error).splitlines()[0]}",
            flush=True,
        )


def run_pair(args: list[str]) -> bool:
    """The two processes, each a host of its own on the one GPU; their output's last lines are printed."""
    procs = []
    for rank in range(2):
        env = dict(
            os.environ, NCCL_HOSTID=f"threadpar-host-{rank}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1"
        )
        cmd = [sys.executable, "-m", "benchmarks.nccl_two_hosts", *args, str(rank)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    ok = True
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\nprocess {rank}: timed out after {TIMEOUT_S} s"
        ok &= proc.returncode == 0 and "FAIL" not in out
        tail = out.strip().splitlines()[-12:]
        print("\n".join(line for line in tail if line.strip()))
    return ok


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "binding":
        member(int(sys.argv[3]), Path(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "threadpar":
        threadpar_member(int(sys.argv[3]), int(sys.argv[2]))
        return 0
    if not torch.cuda.is_available():
        print("nccl_two_hosts: needs a CUDA GPU; none here")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        ok = run_pair(["binding", folder])
    with socket.socket() as probe:  # a free port for the launch's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ok &= run_pair(["threadpar", str(port)])
    print(f"nccl_two_hosts: {'every check passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
