"""PipelineParallel: parity with the whole model in one thread, memory, gradient sync, errors, timeline."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.pipeline import (
    PipelineParallel,
    Plan,
    ScheduleError,
    build_chunks,
    build_plan,
    chrome_trace,
    measured_bubble,
    schedule_placement,
    simulate,
)
from threadpar.testing import run_ranks

VOCAB, DIM, SEQ = 13, 8, 3


def make_model(num_layers: int, seed: int = 0) -> nn.Sequential:
    """Embedding, `num_layers` blocks, head; initialised from a private generator (same on every rank)."""
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_layers)]
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), *blocks, nn.Linear(DIM, VOCAB))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits [b, SEQ, VOCAB], targets [b, SEQ]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (batch, SEQ), generator=g), torch.randint(VOCAB, (batch, SEQ), generator=g)


def my_chunks(model: nn.Sequential, v: int, placement: str = "loop") -> list[nn.Sequential]:
    layout = threadpar.get_layout()
    blocks = list(model)[1:-1]
    return build_chunks(
        blocks, pp_size=layout.pp, pp_rank=threadpar.get_coords().pp, chunks_per_stage=v,
        first=model[0], last=model[-1], placement=placement,
    )  # fmt: skip


def reference(num_layers: int, inputs, targets, steps: int = 1, lr: float = 0.0):
    model = make_model(num_layers)
    for _ in range(steps):
        model.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if lr:
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
    return loss.detach(), model


def my_gradients(model: nn.Sequential, chunks) -> dict[str, torch.Tensor]:
    mine = {id(p) for c in chunks for p in c.parameters()}
    return {name: p.grad for name, p in model.named_parameters() if id(p) in mine}


def assert_matches_reference(results, ref_loss, ref_model, key="grads"):
    seen = {}
    for result in results:
        torch.testing.assert_close(result["loss"], ref_loss)  # every stage reports the mean loss
        seen.update(result[key])
    expected = {name: (p.grad if key == "grads" else p.detach()) for name, p in ref_model.named_parameters()}
    assert seen.keys() == expected.keys()  # every parameter is held by exactly one stage
    for name, value in seen.items():
        torch.testing.assert_close(value, expected[name], msg=lambda m, name=name: f"{name}: {m}")


CASES = [
    # (schedule, pp, v, n): n in {pp, 2 pp, an odd count where allowed}
    *[("afab", pp, 1, n) for pp, n in [(2, 2), (2, 4), (2, 3), (4, 4), (4, 8), (4, 5)]],
    *[("1f1b", pp, 1, n) for pp, n in [(2, 2), (2, 4), (2, 3), (4, 4), (4, 8), (4, 5)]],
    *[("interleaved", pp, 2, n) for pp, n in [(2, 2), (2, 4), (2, 6), (4, 4), (4, 8)]],
    ("afab", 2, 2, 3),
    ("interleaved", 1, 3, 2),  # one rank, three chunks: messages to itself
]


@pytest.mark.parametrize("schedule,pp,v,n", CASES, ids=lambda x: str(x))
def test_train_step_matches_the_whole_model_in_one_thread(schedule, pp, v, n):
    num_layers = pp * v + 3  # never a multiple of the chunk count here: uneven splits
    inputs, targets = make_batch(2 * n)
    ref_loss, ref_model = reference(num_layers, inputs, targets)
    expected_peaks = simulate(build_plan(schedule, pp, n, v)).peak_in_flight

    def body():
        model = make_model(num_layers)
        chunks = my_chunks(model, v)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=n)
        loss = pipe.train_step(inputs, targets)
        assert pipe.peak_saved_activations == expected_peaks[pipe.stage]
        return {"loss": loss, "grads": my_gradients(model, chunks)}

    assert_matches_reference(run_ranks(body, pp, pp=pp), ref_loss, ref_model)


def test_parameters_match_after_several_optimizer_steps():
    inputs, targets = make_batch(8)
    ref_loss, ref_model = reference(5, inputs, targets, steps=3, lr=0.1)

    def body():
        model = make_model(5)
        chunks = my_chunks(model, 1)
        params = [p for c in chunks for p in c.parameters()]
        optimizer = torch.optim.SGD(params, lr=0.1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, num_microbatches=4, optimizer=optimizer)
        losses = [pipe.train_step(inputs, targets) for _ in range(3)]
        assert all(p.grad is None for p in params)  # the optimizer argument also zeroes the gradients
        mine = {id(p) for p in params}
        return {
            "loss": losses[-1],
            "params": {k: p.detach() for k, p in model.named_parameters() if id(p) in mine},
        }

    assert_matches_reference(run_ranks(body, 2, pp=2), ref_loss, ref_model, key="params")


def test_data_parallel_pipelines_each_use_their_own_group():
    batches = [make_batch(4, seed=s) for s in (1, 2)]
    refs = [reference(5, *b) for b in batches]

    def body():
        inputs, targets = batches[threadpar.get_coords().dp]
        model = make_model(5)
        chunks = my_chunks(model, 1)
        # group=None: this rank's own PP group
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, num_microbatches=2)
        return {"loss": pipe.train_step(inputs, targets), "grads": my_gradients(model, chunks)}

    results = run_ranks(body, 4, pp=2, dp=2)
    layout = threadpar.Layout.build(4, pp=2)
    for dp in (0, 1):
        ranks = [r for r in range(4) if layout.coords_of(r).dp == dp]
        assert_matches_reference([results[r] for r in ranks], *refs[dp])


class CountingDDP(nn.Module):
    """A stand-in for DistributedDataParallel: counts the gradient syncs that no_sync() does not suppress."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.sync_enabled = True
        self.synced: list[tuple[str, torch.Tensor]] = []  # (parameter, its gradient when synced)
        for name, p in module.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._on_grad(name, p))

    def _on_grad(self, name: str, p: nn.Parameter) -> None:
        if self.sync_enabled:
            self.synced.append((name, p.grad.clone()))

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def forward(self, x):
        return self.module(x)


@pytest.mark.parametrize(
    "schedule,v",
    [("1f1b", 1), ("interleaved", 2), ("afab", 2), ("zbh1", 1), ("zb_interleaved", 2), ("zbv", 2)],
)
def test_ddp_chunks_sync_gradients_once_per_step_after_the_last_microbatch(schedule, v):
    """Zero-bubble schedules too: their W's accumulate through AccumulateGrad, so the sync comes in each
    chunk's last W."""
    inputs, targets = make_batch(8)

    def body():
        chunks = [CountingDDP(c) for c in my_chunks(make_model(6), v, schedule_placement(schedule))]
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=4)
        for _ in range(2):
            for c in chunks:
                c.synced.clear()
                c.zero_grad()
            pipe.train_step(inputs, targets)
            for c in chunks:
                params = dict(c.module.named_parameters())
                assert sorted(name for name, _ in c.synced) == sorted(params)  # once per parameter
                for name, grad in c.synced:  # ... and only once all microbatches were accumulated
                    torch.testing.assert_close(grad, params[name].grad)

    run_ranks(body, 2, pp=2)


def test_eval_step_returns_the_output_on_the_last_stage():
    inputs, _ = make_batch(6)
    expected = make_model(5)(inputs).detach()

    def body():
        pipe = PipelineParallel(
            my_chunks(make_model(5), 2), loss_fn=lm_loss, schedule="interleaved", num_microbatches=2
        )
        return pipe.eval_step(inputs)

    outputs = run_ranks(body, 2, pp=2)
    assert outputs[0] is None
    torch.testing.assert_close(outputs[1], expected)
    assert not outputs[1].requires_grad


def test_a_frozen_first_chunk_leaves_no_message_behind():
    inputs, targets = make_batch(4)
    ref_model = make_model(2)
    ref_model[0].requires_grad_(False)
    ref_model[1].requires_grad_(False)
    for _ in range(2):  # two steps: gradients accumulate, and a stale message would corrupt the second
        ref_loss = lm_loss(ref_model(inputs), targets)
        ref_loss.backward()

    def body():
        model = make_model(2)
        model[0].requires_grad_(False)
        model[1].requires_grad_(False)
        chunks = my_chunks(model, 1)  # stage 0: embedding and block 0, all frozen
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, num_microbatches=2)
        for _ in range(2):
            loss = pipe.train_step(inputs, targets)
        return {
            "loss": loss,
            "grads": {k: v for k, v in my_gradients(model, chunks).items() if v is not None},
        }

    results = run_ranks(body, 2, pp=2)
    torch.testing.assert_close(results[1]["loss"], ref_loss.detach())
    assert results[0]["grads"] == {}
    for name, p in ref_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(results[1]["grads"][name], p.grad)


def test_timeline_records_actions_and_messages_and_exports_a_chrome_trace():
    inputs, targets = make_batch(8)

    def body():
        pipe = PipelineParallel(my_chunks(make_model(4), 1), loss_fn=lm_loss, num_microbatches=4)
        pipe.train_step(inputs, targets)
        return pipe.timeline

    timelines = run_ranks(body, 2, pp=2)
    for t in timelines:
        actions = [e.name for e in t.events if e.category in ("forward", "backward")]
        assert actions == [str(a) for a in build_plan("1f1b", 2, 4).actions[t.stage]]
        assert all(e.end >= e.start for e in t.events)
    # stage 0 sends 4 activations and receives 4 gradients; stage 1 the other way round
    recvs = sorted(e.name for e in timelines[0].events if e.category == "recv")
    assert recvs == ["recv 0B0", "recv 0B1", "recv 0B2", "recv 0B3"]
    assert sorted(e.name for e in timelines[1].events if e.category == "recv")[0] == "recv 0F0"
    assert 0.0 <= measured_bubble(timelines) < 1.0
    trace = json.loads(json.dumps(chrome_trace(timelines)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(t.events) for t in timelines)
    assert {e["tid"] for e in spans} == {0, 1} and min(e["ts"] for e in spans) == 0.0


class FailsOnThirdCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("bad input in microbatch 2")
        return self.linear(x)


def test_a_failing_action_is_marked_on_the_schedule_grid():
    def body():
        stage = threadpar.get_coords().pp
        chunk = FailsOnThirdCall() if stage == 1 else nn.Linear(DIM, DIM)
        pipe = PipelineParallel(chunk, loss_fn=F.mse_loss, schedule="1f1b", num_microbatches=4)
        pipe.train_step(torch.randn(8, DIM), torch.randn(8, DIM))

    with pytest.raises(RuntimeError, match="bad input in microbatch 2") as caught:
        run_ranks(body, 3, pp=3)
    report = "\n".join(caught.value.__notes__)
    assert "failed on rank 1 (stage 1) in action 1F2" in report
    assert "r1     .   1F0  1F1   .   1B0 [1F2] 1B1" in report
    assert "[x] = the failing action" in report


def test_configuration_errors_are_raised_at_construction_and_name_the_fix():
    def body():
        stage = threadpar.get_coords().pp
        with pytest.raises(ConfigError, match="multiple of 2; got 3"):
            PipelineParallel(
                [nn.Linear(2, 2)] * 2, loss_fn=F.mse_loss, schedule="interleaved", num_microbatches=3
            )
        with pytest.raises(ConfigError, match="'1f1b' runs one chunk per rank"):
            PipelineParallel([nn.Linear(2, 2)] * 2, loss_fn=F.mse_loss, num_microbatches=2)
        with pytest.raises(TypeError, match=r"schedule must be a name .* or a Plan, got list"):
            PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, schedule=["1f1b"], num_microbatches=2)
        with pytest.raises(TypeError, match="loss_fn must be callable"):
            PipelineParallel(nn.Linear(2, 2), loss_fn="mse", num_microbatches=2)
        with pytest.raises(ConfigError, match="num_microbatches must be a positive int"):
            PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, num_microbatches=0)
        deadlock = Plan.parse("r0: 0F0 0B0 0F1 0B1\nr1: 1F1 1F0 1B0 1B1")
        with pytest.raises(ScheduleError, match="deadlocks"):
            PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, schedule=deadlock, num_microbatches=2)
        with pytest.raises(ConfigError, match=r"the plan '1f1b' is for \{'pp': 2, 'n': 4"):
            PipelineParallel(
                nn.Linear(2, 2), loss_fn=F.mse_loss, schedule=build_plan("1f1b", 2, 4), num_microbatches=2
            )
        # Stages that disagree find out together at construction, instead of hanging in the first step.
        with pytest.raises(ConfigError, match="stage 0: 1 chunks, n=2, stage 1: 1 chunks, n=4"):
            PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, num_microbatches=2 + 2 * stage)
        pipe = PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, num_microbatches=2)
        if stage == 0:  # these fail before any message is sent
            with pytest.raises(ConfigError, match=r"batch size 3 .* multiple of num_microbatches=2"):
                pipe.train_step(torch.zeros(3, 2))
            with pytest.raises(TypeError, match="first stage needs inputs as a tensor"):
                pipe.train_step(None)
        # the custom plan that equals the built-in one works
        custom = Plan.parse(str(build_plan("1f1b", 2, 2)))
        ok = PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, schedule=custom, num_microbatches=2)
        return ok.train_step(torch.ones(2, 2), torch.zeros(2, 2))

    losses = run_ranks(body, 2, pp=2)
    torch.testing.assert_close(losses[0], losses[1])


def test_a_loss_that_is_not_a_scalar_is_refused():
    def body():
        pipe = PipelineParallel(nn.Linear(2, 2), loss_fn=lambda y, t: (y - t) ** 2, num_microbatches=2)
        with pytest.raises(ConfigError, match=r"loss_fn must return a scalar tensor .*got Tensor\[1, 2\]"):
            pipe.train_step(torch.zeros(2, 2), torch.zeros(2, 2))

    run_ranks(body, 1)


class BadGradient(nn.Module):
    """A linear layer whose backward raises."""

    class Raise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("bad gradient")

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.Raise.apply(self.linear(x))


def test_a_failing_backward_stops_every_stage_and_is_reported_once():
    def body():
        chunk = BadGradient() if threadpar.get_coords().pp == 2 else nn.Linear(DIM, DIM)
        pipe = PipelineParallel(chunk, loss_fn=F.mse_loss, num_microbatches=4)
        pipe.train_step(torch.randn(8, DIM), torch.randn(8, DIM))

    with pytest.raises(threadpar.RankFailedError) as caught:
        threadpar.launch(body, world_size=4, pp=4, devices="cpu", timeout=20)
    failed = caught.value
    # The stages blocked in a receive stop as a consequence; only the cause is reported.
    assert (failed.rank, type(failed.error), failed.other_failed_ranks) == (2, ValueError, [])
    assert "in action 2B0 (backward of microbatch 0 through chunk 2)" in str(failed)
    assert "[2B0]" in str(failed)
