"""The facts the CUDA/NCCL double models, observed on a real GPU in a process of their own (plain torch: no
double installed, so torch's accelerator is CUDA), for tests/cuda/test_double_rules_gpu.py.

`python tests/cuda/gpu_facts.py NAME...` runs each named fact and prints one JSON line per fact:
{"fact": NAME, "ok": true, ...what it observed} or {"fact": NAME, "ok": false, "error": "Type: message"}.
A fact that would hang prints {"fact": NAME, "started": true} first (its caller kills the process after a
while). Facts that need more GPUs than the machine has print {"fact": NAME, "skip": why}. A fact that breaks a
capture leaves the process's allocator capturing (aten/src/ATen/cuda/CUDAGraph.cpp, capture_end), so the caller
runs each of those in a process of its own."""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second on a 2 GHz GPU
FACTS: dict[str, Callable[[], dict[str, Any]]] = {}


def fact(gpus: int = 1) -> Callable[[Callable[[], dict[str, Any]]], Callable[[], dict[str, Any]]]:
    def register(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            if torch.cuda.device_count() < gpus:
                return {"skip": f"needs {gpus} GPUs; this machine has {torch.cuda.device_count()}"}
            return fn()

        FACTS[fn.__name__] = run
        return fn

    return register


def error_of(fn: Callable[[], Any]) -> str | None:
    """What `fn` raised, as "Type: message" (with the message of what it raised during, if any), or None."""
    try:
        fn()
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if error.__context__ is not None:
            text += f" (during: {type(error.__context__).__name__}: {error.__context__})"
        return text
    return None


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


# -- streams, events, copies -----------------------------------------------------------------------------------
@fact()
def wait_latest_record() -> dict[str, Any]:
    """cudaStreamWaitEvent waits for the record the event had when the wait was issued: `waited` (on the
    waiting stream) ends before the first stream's second sleep, whose record came after the wait."""
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    event = torch.cuda.Event()
    after_first, waited, after_second = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        event.record(first)
        after_first.record(first)
    second.wait_event(event)
    waited.record(second)
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        event.record(first)  # a later record: the wait above is not for it
        after_second.record(first)
    torch.cuda.synchronize()
    # elapsed_time(end) = end - start in ms, from the device's clock: no host timing involved
    return {
        "first_to_waited_ms": after_first.elapsed_time(waited),
        "waited_to_second_ms": waited.elapsed_time(after_second),
    }


@fact()
def stream_pool() -> dict[str, Any]:
    handles = [torch.cuda.Stream().cuda_stream for _ in range(64)]
    high = torch.cuda.Stream(priority=-1).cuda_stream
    a, b = torch.cuda.current_stream(), torch.cuda.current_stream()
    return {
        "distinct_of_32": len(set(handles[:32])),
        "wraps": all(handles[i] == handles[i + 32] for i in range(32)),
        "high_priority_apart": high not in handles,
        "equal_and_same_hash": a == b and hash(a) == hash(b) and a is not b,
    }


@fact()
def copy_synchronizes() -> dict[str, Any]:
    """A copy to pageable host memory (and .item(), .tolist()) waits for the current stream; a non_blocking copy
    to pinned memory does not (its stream still sleeps when the call returns)."""
    x = torch.ones(1 << 16, device="cuda")
    seen = {}
    for name, read in (
        ("cpu", lambda: x.cpu()),
        ("item", lambda: x[0].item()),
        ("tolist", lambda: x[:4].tolist()),
    ):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        before = torch.cuda.Event()
        before.record()
        read()
        seen[f"{name}_waited"] = before.query()
    pinned = torch.empty(x.shape, pin_memory=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    before = torch.cuda.Event()
    before.record()
    pinned.copy_(x, non_blocking=True)
    seen["pinned_non_blocking_waited"] = before.query()
    torch.cuda.synchronize()
    seen["pinned_arrived"] = bool(pinned.eq(1).all())
    return seen


@fact(gpus=2)
def device_synchronize_one_gpu() -> dict[str, Any]:
    with torch.cuda.device(1):
        torch.cuda._sleep(SLEEP_CYCLES)
        busy = torch.cuda.Event()
        busy.record()
    torch.cuda.synchronize(0)
    other_done_after_gpu0 = busy.query()
    torch.cuda.synchronize(1)
    return {"gpu1_done_after_sync_of_gpu0": other_done_after_gpu0, "gpu1_done_after_its_own": busy.query()}


@fact(gpus=2)
def event_one_device() -> dict[str, Any]:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(0))
    return {"error": error_of(lambda: event.record(torch.cuda.Stream(device=1)))}


# -- device tensors -------------------------------------------------------------------------------------------------
@fact()
def same_device() -> dict[str, Any]:
    """The op table of tests/test_sim_gpu.py's mixing test, on a GPU."""
    x = torch.ones(3, 4, device="cuda")
    ops = {
        "add": lambda: x + torch.ones(3, 4),
        "add_scalar": lambda: x + torch.tensor(2.0),
        "mm": lambda: x @ torch.ones(4, 2),
        "cat": lambda: torch.cat([x, torch.ones(3, 4)]),
        "where_scalar": lambda: torch.where(x > 0, x, torch.tensor(0.0)),
        "mul_": lambda: x.mul_(torch.ones(3, 4)),
        "index_cpu": lambda: x[torch.tensor([0, 2])],
    }
    outcome = {}
    for name, op in ops.items():
        error = error_of(op)
        outcome[name] = "ran" if error is None else "refused" if "same device" in error else f"other: {error}"
    return outcome


@fact()
def numpy_refused() -> dict[str, Any]:
    return {"error": error_of(lambda: torch.ones(2, device="cuda").numpy())}


@fact()
def device_generator() -> dict[str, Any]:
    host_state = torch.get_rng_state()
    torch.cuda.manual_seed(5)
    a = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(5)
    b = torch.rand(4, device="cuda")
    return {"repeats": torch.equal(a, b), "host_untouched": torch.equal(torch.get_rng_state(), host_state)}


@fact()
def pinned_memory() -> dict[str, Any]:
    t = torch.ones(4)
    return {"pinned": t.pin_memory().is_pinned(), "plain": t.is_pinned()}


@fact(gpus=2)
def current_device_per_thread() -> dict[str, Any]:
    torch.cuda.set_device(1)
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["thread_current"] = torch.cuda.current_device()
        seen["thread_factory"] = torch.empty(1, device="cuda").device.index

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    seen["main_factory"] = torch.empty(1, device="cuda").device.index
    torch.cuda.set_device(0)
    return seen


@fact()
def invalid_ordinal() -> dict[str, Any]:
    return {"error": error_of(lambda: torch.cuda.set_device(torch.cuda.device_count()))}


@fact()
def autocast_policy() -> dict[str, Any]:
    torch.manual_seed(0)
    x, w, target = (torch.randn(*s, device="cuda") for s in ((3, 4), (5, 4), (3, 5)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
        values = {
            "linear": y,
            "mse_loss": torch.nn.functional.mse_loss(y, target),
            "softmax": y.softmax(-1),
            "norm": y.norm(),
            "addcmul": torch.addcmul(y, x @ w.t(), y.float()),
            "plain": y + 1,
        }
    with torch.autocast("cuda"):
        default = torch.nn.functional.linear(x, w).dtype
        bce = error_of(
            lambda: torch.nn.functional.binary_cross_entropy(
                torch.rand(3, device="cuda"), torch.rand(3, device="cuda")
            )
        )
    return {"dtypes": {k: str(v.dtype) for k, v in values.items()}, "default": str(default), "bce": bce}


@fact()
def backward_error() -> dict[str, Any]:
    class Failed(Exception):
        pass

    def fail(grad: torch.Tensor) -> None:
        raise Failed("from the hook")

    w = torch.nn.Parameter(torch.ones(3, device="cuda"))
    y = w * 2
    y.register_hook(fail)
    error = error_of(lambda: y.sum().backward())
    v = torch.nn.Parameter(torch.ones(3, device="cuda"))
    (v * 3).sum().backward()
    return {"error": error, "goes_on": v.grad.tolist()}


@fact()
def deepcopy_device() -> dict[str, Any]:
    t = torch.arange(4.0, device="cuda")
    c = copy.deepcopy(t)
    leaf = torch.ones(2, device="cuda", requires_grad=True)
    return {
        "device": str(c.device),
        "equal": torch.equal(c, t),
        "own_memory": c.data_ptr() != t.data_ptr(),
        "non_leaf": error_of(lambda: copy.deepcopy(leaf * 2)),
    }


# -- CUDA graphs ----------------------------------------------------------------------------------------------------
@fact()
def capture_states() -> dict[str, Any]:
    """capture_begin on the default stream; a second capture of one graph; replays without a capture."""
    seen: dict[str, Any] = {"default_stream": error_of(lambda: torch.cuda.CUDAGraph().capture_begin())}
    seen["replay_uncaptured"] = error_of(lambda: torch.cuda.CUDAGraph().replay())
    side, x = torch.cuda.Stream(), torch.ones(2, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        x.add_(1)
    with torch.cuda.stream(
        side
    ):  # (capture_begin directly: torch.cuda.graph's __enter__ would keep the stream)
        seen["second_capture"] = error_of(lambda: graph.capture_begin())
    graph.replay()
    graph.reset()
    seen["replay_after_reset"] = error_of(graph.replay)
    return seen


@fact()
def capture_records_not_runs() -> dict[str, Any]:
    x = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(2)
    torch.cuda.synchronize()
    after_capture = x.tolist()
    graph.replay()
    torch.cuda.synchronize()
    once = x.tolist()
    graph.replay()
    torch.cuda.synchronize()
    return {"after_capture": after_capture, "after_one_replay": once, "after_two": x.tolist()}


@fact()
def graph_generators() -> dict[str, Any]:
    out = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(torch.rand(4, device="cuda"))
    graph.replay()
    first = out.clone()
    graph.replay()
    return {"differ": not torch.equal(first, out)}


@fact()
def outside_stream_runs_once() -> dict[str, Any]:
    x, z = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    other = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        x.add_(1)
        with torch.cuda.stream(other):  # (never joined the capture: runs now)
            z.add_(1)
    torch.cuda.synchronize()
    at_capture = z.item()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    return {"outside_after_capture": at_capture, "outside_after_replays": z.item(), "captured": x.item()}


@fact()
def host_scalar_frozen() -> dict[str, Any]:
    lr = torch.tensor(2.0)  # a host 0-dim tensor: a kernel argument, read at launch
    x, out = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(x * lr)
    lr.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    return {"replayed": out.tolist()}


@fact()
def captured_event() -> dict[str, Any]:
    side, x = torch.cuda.Stream(), torch.ones(2, device="cuda")
    event = torch.cuda.Event()
    event.record(side)  # (made before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        x.add_(1)
        event.record()
    return {
        "query": error_of(event.query),
        "synchronize": error_of(event.synchronize),
        "wait": error_of(lambda: torch.cuda.current_stream().wait_event(event)),
    }


@fact()
def optimizer_capturable() -> dict[str, Any]:
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    p.grad = torch.ones(4, device="cuda")
    optimizer = torch.optim.Adam([p], lr=0.1, capturable=False)
    graph = torch.cuda.CUDAGraph()

    def step() -> None:
        with torch.cuda.graph(graph):
            optimizer.step()

    return {"error": error_of(step)}


# each of these breaks its capture: run alone
@fact()
def capture_isolation() -> dict[str, Any]:
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    outside = torch.cuda.Event()
    with torch.cuda.stream(other):
        torch.cuda._sleep(1000)
        outside.record(other)
    graph = torch.cuda.CUDAGraph()

    def capture() -> None:
        with torch.cuda.graph(graph, stream=side):
            side.wait_event(outside)

    return {"error": error_of(capture)}


@fact()
def fork_not_joined() -> dict[str, Any]:
    side, fork = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.ones(2, device="cuda")
    graph = torch.cuda.CUDAGraph()

    def capture() -> None:
        with torch.cuda.graph(graph, stream=side):
            fork.wait_stream(side)  # joins the capture
            with torch.cuda.stream(fork):
                x.add_(1)  # never joined back

    return {"error": error_of(capture)}


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


def main(names: list[str]) -> None:
    for name in names:
        try:
            record = {"fact": name, "ok": True, **FACTS[name]()}
        except Exception as error:
            record = {"fact": name, "ok": False, "error": f"{type(error).__name__}: {error}"}
        emit(record)
    os._exit(0)  # (no teardown: a fact may leave NCCL threads waiting for a peer that never comes)


if __name__ == "__main__":
    main(sys.argv[1:])
