"""Can one GPU hold a 2-rank NCCL communicator across two processes? NCCL refuses two ranks of a communicator
on one GPU ("Duplicate GPU detected", src/init.cc), detected by host hash and bus id; two processes that each
claim a host of their own (a different NCCL_HOSTID each, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, so they connect
over sockets) are reported to form one. If so, the cross-process path can be tested for real on a one-GPU
machine. This script tries it through threadpar's binding: ncclCommInitRank with the id passed in a file,
every collective and a send/recv pair checked against the expected values, then process 1 exits without
its part of an all-reduce and process 0 reports whether ncclCommAbort ends the waiting kernel.

    python -m benchmarks.nccl_two_hosts      # prints one line per check; exit 0 when all passed
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TIMEOUT_S = 50


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


def main() -> int:
    if len(sys.argv) == 3:
        member(int(sys.argv[1]), Path(sys.argv[2]))
        return 0
    if not torch.cuda.is_available():
        print("nccl_two_hosts: needs a CUDA GPU; none here")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for rank in range(2):
            env = dict(
                os.environ, NCCL_HOSTID=f"threadpar-host-{rank}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1"
            )
            cmd = [sys.executable, "-m", "benchmarks.nccl_two_hosts", str(rank), folder]
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
    print(f"nccl_two_hosts: {'every check passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
