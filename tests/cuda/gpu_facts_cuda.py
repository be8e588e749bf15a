"""The torch and CUDA facts the double models (streams, events, copies, device tensors, CUDA graphs), as
gpu_facts.py runs them on a real GPU."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from gpu_facts import SLEEP_CYCLES, error_of, fact


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
