"""Whole-step CUDA graphs on rank threads (threadpar.graphed_step), over the double's capture and replay
(fakes/fake_graph.py): graphed runs against eager single-thread references, and what a capture refuses."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from fakes import sim_gpu
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar
from threadpar import GraphCaptureError
from threadpar.parallel import DistributedDataParallel

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("fake_mode")]

STEPS = 8


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def data(world: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)) for _ in range(steps)
    ]


def reference(
    template: torch.nn.Module, batches, world: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One thread, the whole batch, on a GPU of the double (capturable AdamW's arithmetic): the losses (mean of
    the ranks' losses) and the parameters at the end, on the host."""
    gpu = sim_gpu.device(0)
    model = copy.deepcopy(template).to(gpu)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
    losses = []
    for x, y in batches:
        x, y = x.to(gpu), y.to(gpu)
        opt.zero_grad(set_to_none=False)
        per_rank = [
            torch.nn.functional.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world), y.chunk(world))
        ]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().cpu())
    return losses, [p.detach().cpu() for p in model.parameters()]


def ddp_body(template, batches, warmup, graphed=True):
    def body():
        rank, world, dev = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
        model = DistributedDataParallel(copy.deepcopy(template).to(dev))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            everyone = loss.detach().clone()
            threadpar.all_reduce(everyone)
            return everyone / world

        step = threadpar.graphed_step(train, warmup_steps=warmup) if graphed else train
        losses = []
        for x, y in batches:
            losses.append(step(x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev)).cpu())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    return body


@pytest.mark.parametrize("warmup", [1, 3])
def test_a_graphed_ddp_step_matches_eager_single_thread(warmup):
    template, batches = mlp(), data(2)
    losses, params = reference(template, batches, 2)
    fake = FakeCuda()
    results = run_fake_gpus(ddp_body(template, batches, warmup), 2, fake)
    for got_losses, got_params, step in results:
        assert step.replays == STEPS - warmup
        torch.testing.assert_close(torch.stack(got_losses), torch.stack(losses))
        for got, want in zip(got_params, params):
            torch.testing.assert_close(got, want)
    assert fake.races == []


def graphed_and_eager(make, world: int, *, warmup: int = 2, steps: int = 6, **layout):
    """Run make()'s step on every rank `steps` times, graphed and eagerly (each on a double of its own).
    make() -> (train(*batch) -> a loss tensor, state() -> tensors to compare, batch(i) -> the i-th arguments)."""

    def run(graphed: bool):
        def body():
            train, state, batch = make()
            step = threadpar.graphed_step(train, warmup_steps=warmup) if graphed else train
            dev = threadpar.get_device()
            losses = [step(*(a.to(dev) for a in batch(i))).detach().cpu() for i in range(steps)]
            replays = step.replays if graphed else None
            return torch.stack(losses), [t.detach().cpu() for t in state()], replays

        fake = FakeCuda()
        results = run_fake_gpus(body, world, fake, **layout)
        assert fake.races == []
        return results

    return run(True), run(False)


def assert_graphed_equals_eager(graphed, eager, steps=6, warmup=2):
    for (g_losses, g_state, replays), (e_losses, e_state, _) in zip(graphed, eager):
        assert replays == steps - warmup
        torch.testing.assert_close(g_losses, e_losses, rtol=0, atol=0)
        for g, e in zip(g_state, e_state):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_tensor_and_sequence_parallel_gpt_with_ddp_and_clipping_graphs_as_it_runs_eagerly():
    from threadpar.models.gpt import GPT, GPTConfig, GPTLoss, TensorParallel
    from threadpar.models.parallelize_gpt import parallelize_chunk
    from threadpar.parallel import clip_grad_norm_

    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8)
    dense = GPT(config).init_weights(torch.Generator().manual_seed(3)).state_dict()
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, config.vocab_size, (6, 4, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (6, 4, config.block_size), generator=g)

    def make():
        tp = TensorParallel(group=threadpar.get_group("TP"), sequence_parallel=True)
        model = parallelize_chunk(GPT(config).to(threadpar.get_device()), tp=tp)
        model.load_state_dict(dense)
        model = DistributedDataParallel(model)
        criterion = GPTLoss(config, tp, None)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True)
        dp = threadpar.get_coords().dp

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = criterion(model(x), y)
            loss.backward()
            clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss

        return (
            train,
            lambda: list(model.parameters()),
            lambda i: (idx[i, 2 * dp : 2 * dp + 2], targets[i, 2 * dp : 2 * dp + 2]),
        )

    graphed, eager = graphed_and_eager(make, 4, dp=2, tp=2)
    assert_graphed_equals_eager(graphed, eager)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_graphs_as_it_runs_eagerly(stage):
    from threadpar.parallel import ZeroRedundancyOptimizer

    template, batches = mlp(), data(2, steps=6)

    def make():
        rank = threadpar.get_rank()
        model = DistributedDataParallel(copy.deepcopy(template).to(threadpar.get_device()), bucket_cap_mb=0)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01, capturable=True
        )

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return (
            train,
            lambda: list(model.parameters()),
            lambda i: (batches[i][0].chunk(2)[rank], batches[i][1].chunk(2)[rank]),
        )

    graphed, eager = graphed_and_eager(make, 2)
    assert_graphed_equals_eager(graphed, eager)


def test_dropout_draws_anew_at_every_replay_as_eager_steps_do():
    from threadpar.parallel.tensor_parallel.random import dropout

    template, batches = mlp(), data(2, steps=6)

    def make():
        rank = threadpar.get_rank()
        model = DistributedDataParallel(copy.deepcopy(template).to(threadpar.get_device()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = threadpar.get_generator()

        def train(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(dropout(model(x), 0.5, generator), y)
            loss.backward()
            opt.step()
            return loss

        return (
            train,
            lambda: list(model.parameters()),
            lambda i: (batches[i][0].chunk(2)[rank], batches[i][1].chunk(2)[rank]),
        )

    graphed, eager = graphed_and_eager(make, 2)
    assert_graphed_equals_eager(graphed, eager)  # (a replay drawing the capture's numbers again would differ)


def test_python_in_the_step_runs_once_at_capture_so_a_branch_is_frozen_as_on_a_gpu():
    mode = ["double"]

    def body():
        def step_fn(x):
            return x * 2 if mode[0] == "double" else x * 3

        step = threadpar.graphed_step(step_fn, warmup_steps=1)
        dev = threadpar.get_device()
        out = [step(torch.full((2,), float(i), device=dev)).cpu() for i in range(2)]
        mode[0] = "triple"  # (eager code would change; the graph replays what was captured)
        out += [step(torch.full((2,), float(i), device=dev)).cpu() for i in range(2, 4)]
        return torch.stack(out)

    for result in run_fake_gpus(body, 1, FakeCuda()):
        torch.testing.assert_close(result, torch.tensor([[0.0, 0.0], [2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]))


def run_refused(step_fn, *, warmup=1, world=2, calls=3):
    def body():
        step = threadpar.graphed_step(step_fn, warmup_steps=warmup)
        for i in range(calls):
            step(torch.full((4,), float(i), device=threadpar.get_device()))

    return run_fake_gpus(body, world, FakeCuda())


def test_a_host_read_in_the_step_is_refused_naming_the_op_and_the_line():
    def step_fn(x):
        total = x.sum()
        if total.item() > 100:  # the line the error names
            x = x * 0
        return x

    with pytest.raises(
        GraphCaptureError, match=r"(?s)_local_scalar_dense.*test_cuda_graphs.py.*if total.item\(\) > 100"
    ):
        run_refused(step_fn)


def test_a_non_capturable_optimizer_is_refused_at_capture():
    template = mlp()

    def body():
        model = copy.deepcopy(template).to(threadpar.get_device())
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # capturable=False: step() reads its step count

        def train(x):
            opt.zero_grad(set_to_none=False)
            model(x).sum().backward()
            opt.step()

        step = threadpar.graphed_step(train, warmup_steps=1)
        for _ in range(2):
            step(torch.ones(2, 6, device=threadpar.get_device()))

    # (torch/optim/optimizer.py, _accelerator_graph_capture_health_check)
    with pytest.raises(
        RuntimeError, match=r"graph capture of step.*AdamW but param_groups' capturable is False"
    ):
        run_fake_gpus(body, 1, FakeCuda())


def test_a_groups_first_collective_inside_the_capture_is_refused_with_what_to_do():
    calls = [0]

    def step_fn(x):
        calls[0] += 1
        if calls[0] > 2:  # (only from the captured call on: the warm-up never made the group's communicators)
            threadpar.all_reduce(x)
        return x

    with pytest.raises(GraphCaptureError, match=r"first NCCL operation of group 'WORLD'.*warmup_steps"):
        run_refused(step_fn)


def test_point_to_point_in_the_step_is_captured_from_the_rehearsal_and_replayed():
    # (more in test_cuda_graphs_pipeline.py) rank 0 sends two messages, rank 1 receives them in the other order
    def make():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        state = torch.zeros(3, device=dev)

        def train(x):
            if rank == 0:
                threadpar.send(x * 2, 1, tag=1)
                threadpar.send(x[:2] + 1, 1, tag=2)
                return x.sum()
            first = threadpar.get_group().recv_tensor(0, tag=2)
            second = torch.empty(3, device=dev)
            threadpar.recv(second, 0, tag=1)
            state.add_(second)
            return first.sum() * second.sum()

        return train, lambda: [state], lambda i: (torch.arange(3.0) + i,)

    graphed, eager = graphed_and_eager(make, 2)
    assert_graphed_equals_eager(graphed, eager)


def test_a_receive_from_any_source_inside_the_capture_is_refused():
    def step_fn(x):
        if threadpar.get_rank() == 0:
            threadpar.send(x, 1)
        else:
            threadpar.recv(x)
        return x

    with pytest.raises(GraphCaptureError, match=r"any source.*name the source"):
        run_refused(step_fn)


def test_new_shapes_after_the_capture_are_refused_clearly():
    def body():
        step = threadpar.graphed_step(lambda x: x * 2, warmup_steps=1)
        dev = threadpar.get_device()
        step(torch.ones(3, device=dev))
        step(torch.ones(3, device=dev))
        with pytest.raises(
            threadpar.ConfigError, match=r"argument 0 is float32\[4\], captured as float32\[3\]"
        ):
            step(torch.ones(4, device=dev))
        with pytest.raises(threadpar.ConfigError, match="warmup_steps must be an int >= 1"):
            threadpar.graphed_step(lambda x: x, warmup_steps=0)

    run_fake_gpus(body, 1, FakeCuda())


def test_on_the_threads_backend_the_step_runs_eagerly(monkeypatch):
    said = []
    monkeypatch.setattr("threadpar.cuda_graphs.step.say_once", said.append)

    def body():
        step = threadpar.graphed_step(lambda x: x + threadpar.get_rank(), warmup_steps=1)
        out = [step(torch.zeros(1)) for _ in range(3)]
        return step.graphed, torch.cat(out)

    for rank, (graphed, out) in enumerate(threadpar.launch(body, world_size=2)):
        assert not graphed
        torch.testing.assert_close(out, torch.full((3,), float(rank)))
    assert any("graphed_step runs the step eagerly on the threads backend" in line for line in said)


def test_a_replay_whose_peer_never_replays_is_named_by_the_watchdog():
    def body():
        t = torch.ones(2, device=threadpar.get_device())

        def step_fn(x):
            threadpar.all_reduce(x)
            return x

        step = threadpar.graphed_step(step_fn, warmup_steps=1)
        for _ in range(3):
            step(t)
        if threadpar.get_rank() == 0:
            time.sleep(0.3)  # (the group's probes of the warm-up's operations are settled by now)
            step(t)  # a fourth replay: rank 1 never comes
            while True:  # (the launch's stop ends this)
                time.sleep(0.01)

    # (the replay's watch names it; were the group's probe of its earlier operations still pending on the stream
    # the replays run on, a busy machine, the probe would: both name rank 0 and the graphed step)
    with pytest.raises(threadpar.CollectiveTimeoutError, match=r"(?s)rank 0.*graphed step"):
        run_fake_gpus(body, 2, FakeCuda(), timeout=1.0)


def test_a_learning_rate_held_in_a_device_tensor_changes_inside_the_graph():
    """A schedule reaches a graphed optimizer through a device tensor lr updated in place (torch's capturable
    optimizers read it on the device); a float lr is frozen into the graph at capture, and so is a host tensor's
    value, which the capture refuses (the fused kernels read a host lr with lr.item() when launched:
    FusedAdamWKernel.cu)."""
    template = mlp()

    def run(lr_device):
        def body():
            dev = threadpar.get_device()
            model = copy.deepcopy(template).to(dev)
            lr = torch.tensor(0.01, device=dev if lr_device == "device" else "cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=True)

            def train(x):
                opt.zero_grad(set_to_none=False)
                model(x).square().mean().backward()
                opt.step()

            step = threadpar.graphed_step(train, warmup_steps=1)
            x = torch.ones(2, 6, device=dev)
            step(x)  # (the warm-up)
            moved = []
            for rate in (0.01, 0.0):  # the schedule's values: the replays take them
                lr.fill_(rate)
                before = [p.detach().clone() for p in model.parameters()]
                step(x)
                moved.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
            return step.replays, moved

        return run_fake_gpus(body, 1, FakeCuda())

    assert run("device") == [(2, [True, False])]
    with pytest.raises(GraphCaptureError, match=r"(?s)a host tensor.*Make it a device tensor"):
        run("host")


def test_an_argument_on_the_host_is_refused_at_capture_naming_the_fix():
    def body():
        step = threadpar.graphed_step(lambda x, y: x * y, warmup_steps=1)
        on_device, on_host = torch.ones(3, device=threadpar.get_device()), torch.ones(())
        step(on_device, on_host)  # (eager: a 0-dim host tensor is a scalar a kernel takes)
        with pytest.raises(threadpar.ConfigError, match=r"argument 1 \(float32\[\]\) is on cpu.*\.to\("):
            step(on_device, on_host)

    run_fake_gpus(body, 1, FakeCuda())


def test_a_refused_capture_ends_cleanly_and_the_process_captures_again():
    """A refusal after the capture forked a stream (a send's, joined at the capture's end): the step's GraphCaptureError
    is what the caller sees, not CUDA's unjoined-fork error 904 (whose failed end of capture would also leave
    the allocator's capture underway: fake_graph), and the process captures again afterwards."""

    def body():
        rank, dev, calls = threadpar.get_rank(), threadpar.get_device(), [0]

        def step_fn(x):
            calls[0] += 1
            if rank == 1:
                return threadpar.get_group().recv_tensor(0)
            threadpar.send(
                x * 2, 1
            )  # (captured on the pair's stream: forked, joined back at the capture's end)
            if calls[0] == 3:  # the capture
                x.sum().item()  # refused: a host read, with the send's fork still open
            return x

        step = threadpar.graphed_step(step_fn, warmup_steps=2)
        for i in range(3):
            step(torch.full((4,), float(i), device=dev))

    fake = FakeCuda()
    with pytest.raises(GraphCaptureError, match="_local_scalar_dense") as refused:
        run_fake_gpus(body, 2, fake)
    assert "error 904" not in str(refused.value)
    assert fake.allocator_stuck is None

    def again():
        step = threadpar.graphed_step(lambda x: x * 3, warmup_steps=1)
        return [step(torch.ones(2, device=threadpar.get_device())).cpu() for _ in range(3)]

    for results in run_fake_gpus(again, 1, fake):  # the process captures again
        torch.testing.assert_close(results[-1], torch.full((2,), 3.0))


def test_launches_side_by_side_in_one_process_capture_one_at_a_time():
    """torch's rule is one capture underway per process (notes/cuda.rst, "Constraints"): two launches running at
    once in one process (a notebook's, a test's) take turns with each other too, not only their own ranks (the
    process's NCCL watchdog, paused by a capture, is the lock: runtime/capture_turns.py)."""
    from threadpar.comm.common import graph_capture

    fake = FakeCuda()
    both_warm, both_capturing = threading.Barrier(2), threading.Barrier(2)

    def double(x):
        if graph_capture.capturing():  # (inside a capture: give the other launch's capture 2 s to begin too)
            with contextlib.suppress(threading.BrokenBarrierError):
                both_capturing.wait(timeout=2)
        return x * 2

    def body():
        step = threadpar.graphed_step(double, warmup_steps=1)
        x = torch.ones(3, device=threadpar.get_device())
        step(x)
        both_warm.wait(30)  # (both launches reach their captures together)
        return [step(x).cpu() for _ in range(3)][-1]

    outcomes: list = []

    def launch() -> None:
        try:
            outcomes.append(run_fake_gpus(body, 1, fake))
        except BaseException as error:
            outcomes.append(error)

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 2 and all(isinstance(o, list) for o in outcomes), outcomes
    for (result,) in outcomes:
        torch.testing.assert_close(result, torch.full((3,), 2.0))


@pytest.mark.parametrize("fails", [False, True], ids=["clean end", "failed end"])
def test_a_graphed_steps_graph_is_reset_before_its_communicators_are_freed(fails):
    """NCCL >= 2.26 waits in the last destroy (or abort) of a clique's communicators until every CUDA graph that
    captured them is destroyed (src/init.cc, commDestroySync; the double raises where it would wait for ever):
    the launch's end resets each graphed step's graph first, after a failure too, and a replay after it is
    refused."""
    held = []

    def body():
        x = torch.ones(2, device=threadpar.get_device())

        def step_fn(t):
            threadpar.all_reduce(t)
            return t

        step = threadpar.graphed_step(step_fn, warmup_steps=1)
        for _ in range(3):
            step(x)
        held.append(step)  # (the user still holds the step, and so its graph, after the launch)
        if fails and threadpar.get_rank() == 1:
            raise RuntimeError("rank 1 fails after its replays")

    fake = FakeCuda()
    if fails:
        with pytest.raises(RuntimeError, match="rank 1 fails after its replays"):
            run_fake_gpus(body, 2, fake)
    else:
        run_fake_gpus(body, 2, fake)
    if not fails:  # (a clean end pools the clique: destroying it later must not wait either)
        for comm in fake.cliques.drain():
            comm.destroy()
    assert not fake.nccl.violations
    assert len(fake.nccl.aborted if fails else fake.nccl.destroyed) == 2
    with pytest.raises(threadpar.ConfigError, match="belongs to a launch that has ended"):
        run_fake_gpus(lambda: held[0](torch.ones(2, device=threadpar.get_device())), 1, fake)


def test_a_host_read_inside_the_captured_backward_is_refused_not_fatal():
    """A refusal raised inside backward during the capture (a hook reading a gradient on the host) reaches the
    step's caller as the GraphCaptureError it is (the double's engine boundary: fakes/sim_gpu_engine.py)."""

    def body():
        weight = torch.nn.Parameter(torch.ones(3, device=threadpar.get_device()))
        weight.register_hook(lambda g: g * float(g.sum()))  # a host read of the gradient: .item() in backward

        def step_fn(x):
            (weight * x).sum().backward()
            return weight.grad

        step = threadpar.graphed_step(step_fn, warmup_steps=1)
        for _ in range(3):
            step(torch.ones(3, device=threadpar.get_device()))

    with pytest.raises(GraphCaptureError, match="_local_scalar_dense"):
        run_fake_gpus(body, 1, FakeCuda())
