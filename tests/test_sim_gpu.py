"""The double's GPU device (tests/fakes/sim_gpu.py): device tensors that torch treats as a device of their own."""

from __future__ import annotations

import threading

import pytest
import torch
from fakes import sim_gpu
from torch._subclasses.fake_tensor import FakeTensorMode

DEV: torch.device


@pytest.fixture(autouse=True, scope="module")
def _device():
    global DEV
    sim_gpu.install()
    DEV = sim_gpu.device(1)


def test_device_tensors_compute_what_host_tensors_compute():
    torch.manual_seed(0)
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    da, db = a.to(DEV), b.to(DEV)
    assert (da.device, da.is_simgpu, type(da).__name__) == (DEV, True, "DeviceTensor")
    out = torch.nn.functional.gelu(da @ db).softmax(-1)
    assert out.device == DEV
    torch.testing.assert_close(out.cpu(), torch.nn.functional.gelu(a @ b).softmax(-1))


def test_autograd_and_an_optimizer_step_match_the_host():
    torch.manual_seed(0)
    host = torch.nn.Linear(5, 3)
    dev = torch.nn.Linear(5, 3).to(DEV)
    dev.load_state_dict(host.state_dict())
    x = torch.randn(7, 5)
    for model, inputs in ((host, x), (dev, x.to(DEV))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(inputs).pow(2).mean().backward()
        optimizer.step()
    assert dev.weight.grad.device == DEV
    torch.testing.assert_close(dev.weight.grad.cpu(), host.weight.grad)
    torch.testing.assert_close(dev.weight.detach().cpu(), host.weight.detach())


def test_views_and_in_place_ops_write_the_same_memory():
    t = torch.zeros(2, 4, device=DEV)
    t[1, 1:3].add_(5)
    t.t()[0].fill_(1)
    assert t.tolist() == [[1, 0, 0, 0], [1, 5, 5, 0]]
    u = torch.ones(2, 2, device=DEV)
    u.t_()
    assert u.shape == (2, 2) and u.device == DEV


@pytest.mark.parametrize(
    "name",
    ["add", "add_scalar", "mm", "cat", "where_scalar", "mul_", "index_cpu"],
)
def test_mixing_host_and_device_tensors_is_refused_where_torch_refuses_it(name):
    """Our device's check against torch's own model of device propagation (FakeTensor with fake CUDA tensors):
    each op is refused by both or by neither."""

    def run(d, host):
        x = torch.ones(3, 4, device=d)
        ops = {
            "add": lambda: x + host(torch.ones(3, 4)),
            "add_scalar": lambda: x + host(torch.tensor(2.0)),
            "mm": lambda: x @ host(torch.ones(4, 2)),
            "cat": lambda: torch.cat([x, host(torch.ones(3, 4))]),
            "where_scalar": lambda: torch.where(x > 0, x, host(torch.tensor(0.0))),
            "mul_": lambda: x.mul_(host(torch.ones(3, 4))),
            "index_cpu": lambda: x[host(torch.tensor([0, 2]))],
        }
        try:
            ops[name]()
        except RuntimeError as error:
            return "refused" if "same device" in str(error) else f"other: {error}"
        return "ran"

    ours = run(DEV, lambda t: t)
    expected = {"index_cpu": "ran"}.get(name)  # TensorAdvancedIndexing.cpp moves host indices to the device
    if expected is None:
        with FakeTensorMode(allow_non_fake_inputs=True):
            expected = run(torch.device("cuda", 0), lambda t: t)
    assert ours == expected


def test_a_device_tensor_is_read_on_the_host_only_through_a_copy():
    t = torch.arange(3.0, device=DEV)
    assert t.tolist() == [0.0, 1.0, 2.0]
    assert t.sum().item() == 3.0
    with pytest.raises(TypeError, match="can't convert simgpu:1 device type tensor to numpy"):
        t.numpy()
    assert "0." not in repr(t)  # (a repr does not read the device)


def test_factories_without_an_index_use_the_threads_current_device():
    seen = []

    def worker():
        seen.append(torch.empty(1, device="simgpu").device)
        sim_gpu.set_device(3)
        seen.append(torch.zeros(1, device="simgpu").device)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [sim_gpu.device(0), sim_gpu.device(3)]
    assert torch.get_device_module("simgpu").current_device() == 0  # (this thread's: untouched)


def test_random_ops_draw_from_the_devices_own_generator():
    module = torch.get_device_module("simgpu")
    torch.manual_seed(0)
    sim_gpu.default_generator(1).manual_seed(7)
    first = torch.randn(4, device=DEV).cpu()
    torch.manual_seed(0)  # (the host's generator: not the device's)
    sim_gpu.default_generator(1).manual_seed(7)
    assert torch.equal(torch.randn(4, device=DEV).cpu(), first)
    module.manual_seed_all(3)
    state = module.get_rng_state(DEV)
    drawn = torch.nn.functional.dropout(torch.ones(64, device=DEV), 0.5).cpu()
    module.set_rng_state(state, DEV)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64, device=DEV), 0.5).cpu(), drawn)
    assert set(drawn.tolist()) == {0.0, 2.0}


def test_pinned_host_memory():
    pageable = torch.ones(3)
    pinned = pageable.pin_memory()
    assert pinned.is_pinned() and not pageable.is_pinned()
    assert torch.equal(pinned, pageable)
    assert pinned.to(DEV, non_blocking=True).tolist() == [1.0, 1.0, 1.0]


def test_backward_on_another_thread_of_a_device_above_zero():
    """The engine's device threads cannot serve the double's devices (sim_gpu._backward_without_device_threads):
    a backward with multithreading on runs on the calling thread instead of failing engine.cpp's assert."""
    grads = []

    def worker():
        torch.autograd.set_multithreading_enabled(True)
        x = torch.ones(3, device=sim_gpu.device(5), requires_grad=True)
        (x * 3).sum().backward()
        grads.append(x.grad.cpu())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert grads and grads[0].tolist() == [3.0, 3.0, 3.0]


def test_autocast_casts_as_cuda_does():
    """CUDA's policies (aten/src/ATen/autocast_mode.h's lists): a matmul in the autocast dtype, a loss and a
    softmax's result in float32, float64 left alone."""
    x, w = torch.randn(4, 8, device=DEV), torch.randn(8, 3, device=DEV)
    with torch.autocast(DEV.type, dtype=torch.float16):
        product = x @ w
        loss = torch.nn.functional.mse_loss(product, torch.zeros(4, 3, device=DEV))
        soft = torch.softmax(product, dim=-1)
        wide = x.double() @ w.double()
        linear = torch.nn.functional.linear(x, w.t())
    assert (product.dtype, loss.dtype, soft.dtype, wide.dtype, linear.dtype) == (
        torch.float16, torch.float32, torch.float32, torch.float64, torch.float16,
    )  # fmt: skip
    torch.testing.assert_close(product.float().cpu(), (x.cpu().half() @ w.cpu().half()).float())


@pytest.mark.parametrize(
    "where", ["tensor_hook", "post_accumulate_grad_hook", "device_op", "queued_callback"]
)
def test_an_error_raised_inside_a_backward_reaches_its_caller(where, monkeypatch):
    """On a GPU the engine unwinds its C++ stream guards and backward() raises the callback's error; the double's
    device guard is Python, with which the same error used to terminate the process (sim_gpu_engine.py)."""

    class Failed(Exception):
        pass

    def fail(*args):
        raise Failed(where)

    w = torch.nn.Parameter(torch.ones(3, device=DEV))
    y = w * 2
    if where == "tensor_hook":
        y.register_hook(fail)
    elif where == "post_accumulate_grad_hook":
        w.register_post_accumulate_grad_hook(fail)
    elif where == "queued_callback":
        y.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(fail))
    else:  # the device's own op in a node's backward (C++ calls its __torch_dispatch__)
        compute = sim_gpu._compute
        monkeypatch.setattr(sim_gpu, "_compute", lambda func, args, kwargs: fail())
    with pytest.raises(Failed, match=where) as raised:
        y.sum().backward()
    assert raised.traceback[-1].name == "fail"  # (its own traceback)
    if where == "device_op":
        monkeypatch.setattr(sim_gpu, "_compute", compute)
    v = torch.nn.Parameter(torch.ones(3, device=DEV))
    (v * 3).sum().backward()  # (the device goes on)
    assert v.grad.tolist() == [3.0] * 3


def test_torch_distributed_ops_take_the_device_tensors_themselves():
    """A functional collective's kernel is any device's (torch/csrc/distributed/c10d/Functional.cpp): it hands the
    process group the device tensors, and wait_tensor finds the collective's Work by its output tensor."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

    import threadpar

    def body():
        t = torch.full((2,), float(dist.get_rank() + 1), device=threadpar.get_device())
        out = funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD.group_name))
        return out.device, out.cpu()

    for rank, (device, out) in enumerate(run_fake_gpus(body, 2, FakeCuda())):
        assert device == sim_gpu.device(rank)
        torch.testing.assert_close(out, torch.full((2,), 3.0))


def test_the_device_modules_streams_are_the_bound_fakecudas():
    """torch.simgpu's Stream / current_stream / stream / Event (FSDP2 reaches them as its device handle) are the
    streams of the FakeCuda the thread drives: what they order, the double's device orders."""
    from fakes.fake_cuda_nccl import FakeCuda

    fake, module = FakeCuda(), torch.get_device_module(DEV)
    previous = sim_gpu.bind(fake)
    try:
        side, main = module.Stream(DEV, priority=-1), module.current_stream(DEV)
        assert side.device == DEV and side != main and main == module.current_stream(DEV)
        assert (
            len({main, module.current_stream(DEV)}) == 1
        )  # (one stream, one hash: FSDP2 keys dicts by them)
        with module.stream(side):
            assert module.current_stream(DEV) == side and fake.current_stream(DEV) is side.fake_stream
        assert fake.current_stream(DEV) is main.fake_stream
        produced = fake.mark(side.fake_stream, "produce on the side stream")
        unordered = fake.mark(main.fake_stream, "before the wait")
        main.wait_stream(side)
        consumed = fake.mark(main.fake_stream, "after the wait")
        assert fake.ordered(produced, consumed) and not fake.ordered(produced, unordered)
        event = side.record_event()
        assert event.query() and side.query()
        event.synchronize()
    finally:
        sim_gpu.bind(previous)
    idle = module.current_stream(DEV)  # (a thread bound to no launch: the process's GPUs, idle, as on a GPU)
    assert idle.fake_stream is not main.fake_stream and idle.query()
    idle.synchronize()


def test_deepcopy_copies_the_memory_on_the_device():
    """copy.deepcopy of a device tensor, a parameter and a module (a model's deepcopy before it is parallelized)."""
    import copy

    module = torch.nn.LayerNorm(3).to(DEV)
    with torch.no_grad():
        module.weight.add_(1.0)
    module.weight.grad = torch.ones(3, device=DEV)
    copied = copy.deepcopy(module)
    weight = copied.weight
    assert isinstance(weight, torch.nn.Parameter) and weight.device == DEV and weight.requires_grad
    assert sim_gpu.host(weight).data_ptr() != sim_gpu.host(module.weight).data_ptr()  # (memory of its own)
    torch.testing.assert_close(weight.cpu(), torch.full((3,), 2.0))
    torch.testing.assert_close(weight.grad.cpu(), torch.ones(3))
    with torch.no_grad():
        module.weight.zero_()
    torch.testing.assert_close(weight.cpu(), torch.full((3,), 2.0))
    t = torch.arange(6.0, device=DEV).view(2, 3).t()
    torch.testing.assert_close(copy.deepcopy(t).cpu(), t.cpu())


def test_setting_data_makes_a_parameter_share_the_new_tensors_memory():
    """`p.data = view` (threadpar's ZeRO buckets): p reads and writes the view's memory afterwards, as torch's
    set_data makes it (VariableHooks::set_data: shallow_copy_from, storage included)."""
    p = torch.nn.Parameter(torch.ones(4, device=DEV))
    flat = torch.zeros(8, device=DEV)
    flat[2:6].copy_(p.detach())
    p.data = flat[2:6]
    flat.add_(1)
    assert p.detach().tolist() == [2.0] * 4 and p.device == DEV
    with torch.no_grad():
        p.mul_(3)
    assert flat.tolist() == [1.0, 1.0, 6.0, 6.0, 6.0, 6.0, 1.0, 1.0]


def test_backward_from_gradient_edges_on_another_thread_of_a_device_above_zero():
    """The same from GradientEdges (what threadpar's zero-bubble schedule gives torch.autograd.backward/grad)."""
    grads = []

    def worker():
        torch.autograd.set_multithreading_enabled(True)
        x = torch.ones(3, device=sim_gpu.device(5), requires_grad=True)
        y = x * 3
        edge = torch.autograd.graph.get_gradient_edge(y)
        (grad,) = torch.autograd.grad([edge], [x], [torch.ones(3, device=sim_gpu.device(5))])
        grads.append(grad.cpu())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert grads and grads[0].tolist() == [3.0, 3.0, 3.0]


def test_autocast_on_the_device_casts_as_cuda_autocast_does():
    """torch.autocast("simgpu") (sim_gpu_autocast.py): CUDA's lists, each op in its dtype, the casts recorded for
    backward; the values those of the same casts made explicitly on the host."""
    torch.manual_seed(0)
    x, w, target = torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 5)
    bf16, fp32 = torch.bfloat16, torch.float32

    def step(device, autocast):
        xd, wd = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        low = (lambda t: t) if autocast else (lambda t: t.to(bf16))  # what autocast casts to, made explicit
        high = (lambda t: t) if autocast else (lambda t: t.float())
        with torch.autocast(device.type, dtype=bf16, enabled=autocast):
            y = torch.nn.functional.linear(low(xd), low(wd))  # lower_precision_fp
            loss = torch.nn.functional.mse_loss(high(y), target.to(device))  # fp32
            probs = high(y).softmax(-1)  # fp32_set_opt_dtype
            norm = high(y).norm()  # fp32_append_dtype
            mixed = torch.addcmul(high(y), high(low(xd) @ low(wd).t()), y.float())  # promote: widest, fp32
            plain = y + 1  # not listed: the input's dtype
        loss.backward()
        return [t.detach().cpu() for t in (y, loss, probs, norm, mixed, plain, xd.grad, wd.grad)]

    on_device, on_host = step(DEV, True), step(torch.device("cpu"), False)
    assert [t.dtype for t in on_device] == [bf16, fp32, fp32, fp32, fp32, bf16, fp32, fp32]
    for got, want in zip(on_device, on_host):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.autocast("simgpu"):
        assert (
            torch.nn.functional.linear(x.to(DEV), w.to(DEV)).dtype == torch.float16
        )  # (CUDA's default dtype)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(torch.rand(3, device=DEV), torch.rand(3, device=DEV))


def test_a_device_tensor_set_to_another_device_tensors_storage_shares_its_memory():
    """`t.set_(buffer.untyped_storage(), offset, shape, strides)` (threadpar's packed pipeline messages)."""
    buffer = torch.arange(8.0, device=DEV)
    t = torch.empty(0, device=DEV)
    t.set_(buffer.untyped_storage(), 2, (2, 2), (2, 1))
    assert (t.device, t.shape, t.stride(), t.storage_offset()) == (DEV, (2, 2), (2, 1), 2)
    assert t.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    t.mul_(10)
    assert buffer.tolist() == [0.0, 1.0, 20.0, 30.0, 40.0, 50.0, 6.0, 7.0]


def test_a_device_synchronize_waits_for_that_gpus_streams_only(monkeypatch):
    """FakeCuda.synchronize(simgpu:i) is torch.cuda.synchronize(i): that GPU's streams, not its peers' (whose
    pending collectives may wait for the synchronizing rank's next call)."""
    from fakes import fake_device
    from fakes.fake_cuda_nccl import FakeCuda, FakeStream

    fake = FakeCuda()
    streams = [FakeStream(fake, f"s{i}", sim_gpu.device(i)) for i in (0, 1, 1)]
    for stream in streams:
        fake.mark(stream, "work")
    demanded = []
    monkeypatch.setattr(fake_device, "demand", lambda stream, index, what: demanded.append(stream))
    fake.synchronize(sim_gpu.device(1))
    assert demanded == streams[1:]
    demanded.clear()
    fake.synchronize(torch.device("cpu"))  # (the double's "every GPU": the end of a launch)
    assert demanded == streams
