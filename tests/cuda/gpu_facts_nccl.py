"""The NCCL facts the double models, through threadpar's binding of NCCL's C API, as gpu_facts.py runs them
on a real GPU (some need two)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from gpu_facts import SLEEP_CYCLES, emit, error_of, fact


# -- NCCL through threadpar's binding ------------------------------------------------------------------------------
def _nccl() -> Any:
    from threadpar.comm.nccl.library import nccl_library

    return nccl_library()


@fact()
def blocking_init_waits() -> dict[str, Any]:
    lib = _nccl()
    uid = lib.get_unique_id()
    emit({"fact": "blocking_init_waits", "started": True})
    lib.comm_init_rank(2, uid, 0, 0)  # rank 1 never comes
    return {"returned": True}


@fact()
def nonblocking_init_in_progress() -> dict[str, Any]:
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    comm = lib.comm_init_rank_config(2, lib.get_unique_id(), 0, 0, False)  # rank 1 never comes
    states = set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        states.add(lib.comm_get_async_error(comm))
        time.sleep(0.01)
    x = torch.ones(2, device="cuda")
    error = error_of(lambda: lib.all_reduce(x, x, SUM, comm, torch.cuda.current_stream()))
    return {"states": sorted(states), "call": error}


@fact(gpus=2)
def stream_waits_for_peer() -> dict[str, Any]:
    """Run with NCCL_RUNTIME_CONNECT=0: connections are made at init, so the call does not block the host."""
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    comms = lib.comm_init_all([0, 1])
    xs = [torch.full((2,), float(i + 1), device=f"cuda:{i}") for i in range(2)]
    streams = [torch.cuda.Stream(device=i) for i in range(2)]
    done = torch.cuda.Event()
    returned = threading.Event()

    def rank0() -> None:
        with torch.cuda.device(0):
            lib.all_reduce(xs[0], xs[0], SUM, comms[0], streams[0])
            done.record(streams[0])
        returned.set()

    thread = threading.Thread(target=rank0)
    thread.start()
    seen: dict[str, Any] = {"returned_alone": returned.wait(60)}
    if seen["returned_alone"]:
        time.sleep(0.5)  # (however long: the kernel needs rank 1's part)
        seen["done_before_peer"] = done.query()
    with torch.cuda.device(1):
        lib.all_reduce(xs[1], xs[1], SUM, comms[1], streams[1])
    thread.join(60)
    for s in streams:
        s.synchronize()
    seen["values"] = [x.tolist() for x in xs]
    return seen


@fact(gpus=2)
def launch_order() -> dict[str, Any]:
    """Run with NCCL_RUNTIME_CONNECT=0. Rank 0 issues #1 on a stream that first sleeps a second and #2 on an idle
    stream; rank 1 issues them on two idle streams. #2 still ends after the sleep: a communicator's launches run in
    issue order (src/enqueue.cc, ncclLaunchPrepare waits on the communicator's deviceStream), measured on the
    device's clock."""
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    comms = lib.comm_init_all([0, 1])
    xs = [[torch.ones(2, device=f"cuda:{r}") for _ in range(2)] for r in range(2)]
    streams = [[torch.cuda.Stream(device=r) for _ in range(2)] for r in range(2)]
    slept, second_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(0):
        with torch.cuda.stream(streams[0][0]):
            torch.cuda._sleep(SLEEP_CYCLES)
            slept.record()
        lib.all_reduce(xs[0][0], xs[0][0], SUM, comms[0], streams[0][0])
        lib.all_reduce(xs[0][1], xs[0][1], SUM, comms[0], streams[0][1])
        second_done.record(streams[0][1])
    with torch.cuda.device(1):
        for k in range(2):
            lib.all_reduce(xs[1][k], xs[1][k], SUM, comms[1], streams[1][k])
    for rank in streams:
        for s in rank:
            s.synchronize()
    return {
        "sleep_to_second_ms": slept.elapsed_time(second_done),
        "values": [[x.tolist() for x in r] for r in xs],
    }


@fact(gpus=2)
def group_launches_at_end() -> dict[str, Any]:
    """Run with NCCL_RUNTIME_CONNECT=0. Inside a group, rank 0's all_reduce is not on its stream yet: an event
    recorded after it completes before rank 1 issues (a kernel launched at the call would wait for rank 1)."""
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    comms = lib.comm_init_all([0, 1])
    xs = [torch.ones(2, device=f"cuda:{r}") for r in range(2)]
    streams = [torch.cuda.Stream(device=r) for r in range(2)]
    lib.group_start()
    with torch.cuda.device(0):
        lib.all_reduce(xs[0], xs[0], SUM, comms[0], streams[0])
        inside = torch.cuda.Event()
        inside.record(streams[0])
    time.sleep(0.5)
    done_inside = inside.query()
    with torch.cuda.device(1):
        lib.all_reduce(xs[1], xs[1], SUM, comms[1], streams[1])
    lib.group_end()
    for s in streams:
        s.synchronize()
    return {"event_inside_group_done": done_inside, "values": [x.tolist() for x in xs]}


@fact(gpus=2)
def send_waits_for_receive() -> dict[str, Any]:
    """Connected by a grouped exchange first (point to point connects at first use); then rank 0's ncclSend
    alone returns, and its stream waits until rank 1's ncclRecv runs. The message (256 MiB) is larger than
    NCCL's buffers for a peer (at most 32 channels x 4 MiB: fake_nccl_memory.py), which a small one could
    complete into without the receive (nccl.h calls a send "blocking for the GPU" all the same)."""
    lib = _nccl()
    comms = lib.comm_init_all([0, 1])
    streams = [torch.cuda.Stream(device=r) for r in range(2)]
    lib.group_start()
    for r in range(2):
        with torch.cuda.device(r):
            lib.send(torch.ones(1, device=f"cuda:{r}"), 1 - r, comms[r], streams[r])
            lib.recv(torch.empty(1, device=f"cuda:{r}"), 1 - r, comms[r], streams[r])
    lib.group_end()
    for s in streams:
        s.synchronize()
    n = 1 << 26  # float32: 256 MiB
    sent, received = torch.full((n,), 7.0, device="cuda:0"), torch.zeros(n, device="cuda:1")
    with torch.cuda.device(0):
        lib.send(sent, 1, comms[0], streams[0])
        done = torch.cuda.Event()
        done.record(streams[0])
    time.sleep(0.5)
    done_before_receive = done.query()
    with torch.cuda.device(1):
        lib.recv(received, 0, comms[1], streams[1])
    for s in streams:
        s.synchronize()
    return {"send_done_before_receive": done_before_receive, "received": bool(received.eq(7.0).all())}


@fact(gpus=2)
def abort_ends_kernels() -> dict[str, Any]:
    """Run with NCCL_RUNTIME_CONNECT=0. Rank 0's all_reduce waits for rank 1, which never issues; ncclCommAbort of
    rank 0's communicator ends its kernel, and its stream goes on."""
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    comms = lib.comm_init_all([0, 1])
    x = torch.ones(2, device="cuda:0")
    stream = torch.cuda.Stream(device=0)
    with torch.cuda.device(0):
        lib.all_reduce(x, x, SUM, comms[0], stream)
        done = torch.cuda.Event()
        done.record(stream)
    time.sleep(0.5)
    pending = not done.query()
    lib.comm_abort(comms[0])
    finished = threading.Event()
    threading.Thread(target=lambda: (done.synchronize(), finished.set()), daemon=True).start()
    ended = finished.wait(60)
    lib.comm_abort(comms[1])
    return {"pending_before_abort": pending, "stream_went_on": ended}


@fact(gpus=2)
def first_collective_connects() -> dict[str, Any]:
    """Run with NCCL_RUNTIME_CONNECT unset (NCCL >= 2.22 connects a collective's algorithm at first use)."""
    from threadpar.comm.nccl.library import SUM

    lib = _nccl()
    if lib.version()[:2] < (2, 22):
        return {"skip": f"NCCL {lib.version()} connects at init (NCCL_RUNTIME_CONNECT came in 2.22)"}
    comms = lib.comm_init_all([0, 1])
    xs = [torch.full((2,), float(i + 1), device=f"cuda:{i}") for i in range(2)]
    streams = [torch.cuda.Stream(device=i) for i in range(2)]
    returned = threading.Event()

    def rank0() -> None:
        with torch.cuda.device(0):
            lib.all_reduce(xs[0], xs[0], SUM, comms[0], streams[0])
        returned.set()

    thread = threading.Thread(target=rank0)
    thread.start()
    seen: dict[str, Any] = {"returned_before_peer": returned.wait(5.0)}
    with torch.cuda.device(1):
        lib.all_reduce(xs[1], xs[1], SUM, comms[1], streams[1])
    seen["returned_after_peer"] = returned.wait(60)
    thread.join(60)
    for s in streams:
        s.synchronize()
    seen["values"] = [x.tolist() for x in xs]
    return seen


@fact(gpus=2)
def nonblocking_group_end() -> dict[str, Any]:
    from threadpar.comm.nccl.library import IN_PROGRESS, SUM

    lib = _nccl()
    if lib.version()[:2] < (2, 23):
        return {
            "skip": f"NCCL {lib.version()}: a threaded launch for every nonblocking group end came in 2.23"
        }
    uid = lib.get_unique_id()
    comms = [lib.comm_init_rank_config(2, uid, i, i, False) for i in range(2)]

    def settle(comm: Any) -> int:
        deadline = time.monotonic() + 60
        while (state := lib.comm_get_async_error(comm)) == IN_PROGRESS and time.monotonic() < deadline:
            time.sleep(0.001)
        return state

    ready = [settle(c) for c in comms]
    xs = [torch.full((2,), float(i + 1), device=f"cuda:{i}") for i in range(2)]
    streams = [torch.cuda.Stream(device=i) for i in range(2)]
    lib.group_start()
    for i in range(2):
        with torch.cuda.device(i):
            lib.all_reduce(xs[i], xs[i], SUM, comms[i], streams[i])
    code = lib.group_end()
    settled = [settle(c) for c in comms]
    for s in streams:
        s.synchronize()
    return {"ready": ready, "group_end": code, "settled": settled, "values": [x.tolist() for x in xs]}


@fact()
def torch_init_rank() -> dict[str, Any]:
    import torch.cuda.nccl as torch_nccl

    return {"error": error_of(lambda: torch_nccl.init_rank(1, torch_nccl.unique_id(), 0))}
