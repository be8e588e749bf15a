"""LossScaler's device path (issue 33): the scale, its growth counter and the skipped count live in tensors,
an overflow skips the step on the device (a fused optimizer reads the agreed flag), so a CUDA-graphed step
holds it. Checked: step_on_device equals the host-branching step (one rank's overflow skips everywhere),
also through ZeRO; a graphed DDP step (the double's capture and replay, nccl backend) equals the eager one
with an overflow inside a replay; torch._amp_update_scale_ keeps the rule the host update kept; refusals."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host
from helpers.ddp_reference import rank_slice

import threadpar
from threadpar.parallel import DistributedDataParallel, LossScaler, ZeroRedundancyOptimizer
from threadpar.testing import run_ranks

pytestmark = [pytest.mark.timeout(120)]

BAD_STEP, BAD_RANK = 2, 1


def run_on(runner: str, body, world: int, **layout):
    if runner == "threads":
        return run_ranks(body, world, **layout)
    return run_fake_gpus(body, world, FakeCuda(), **layout)


def fused_adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)


# eager equivalence ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["threads", "double"])
def test_step_on_device_equals_the_host_step_and_one_ranks_overflow_skips_everywhere(runner):
    """Two copies per rank, one stepped by `step` (host branch), one by `step_on_device`; the same scaled
    gradients, rank 1 putting an inf into one of its own at step 2 (no DDP: only the agreement spreads it)."""
    steps = 5

    def body():
        rank, dev = threadpar.get_rank(), threadpar.get_device()
        g = torch.Generator().manual_seed(rank)
        start = [torch.randn(4, 3, generator=g).to(dev), torch.randn(5, generator=g).to(dev)]
        runs = {}
        for path in ("host", "device"):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            runs[path] = (params, fused_adamw(params), LossScaler(init_scale=2.0**6, growth_interval=2))
        g = torch.Generator().manual_seed(100 + rank)
        history = []
        for step in range(steps):
            grads = [torch.randn(p.shape, generator=g).to(dev) for p in start]
            record = {}
            for path, (params, opt, scaler) in runs.items():
                for p, grad in zip(params, grads):
                    p.grad = grad * scaler.scale_tensor  # (what backward of scale_loss(loss) gives)
                if step == BAD_STEP and rank == BAD_RANK:
                    params[1].grad[3] = math.inf
                if path == "host":
                    skipped = not scaler.step(opt, params)
                else:
                    skipped = bool(scaler.step_on_device(opt, params))  # (read after the step, to compare)
                record[path] = (
                    skipped,
                    scaler.scale,
                    scaler.skipped_steps,
                    [p.detach().cpu() for p in params],
                )
            history.append(record)
        return history, {path: to_host(opt.state_dict()["state"]) for path, (_, opt, _) in runs.items()}

    for history, states in run_on(runner, body, 4):
        for step, record in enumerate(history):
            (h_skip, h_scale, h_count, h_params), (d_skip, d_scale, d_count, d_params) = (
                record["host"],
                record["device"],
            )
            assert h_skip == d_skip == (step == BAD_STEP)  # the overflow skipped on every rank
            assert h_scale == d_scale and h_count == d_count == int(step >= BAD_STEP)
            for h, d in zip(h_params, d_params):
                torch.testing.assert_close(d, h)
        torch.testing.assert_close(
            history[BAD_STEP]["device"][3], history[BAD_STEP - 1]["device"][3], rtol=0, atol=0
        )
        # scale 64: grows at step 1 (growth_interval 2), halves at step 2, grows again at step 4
        assert [r["device"][1] for r in history] == [64.0, 128.0, 64.0, 64.0, 128.0]
        torch.testing.assert_close(states["device"], states["host"])  # (step counts: the skip is not counted)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_forwards_the_flag_to_its_fused_optimizer(stage):
    """ZeroRedundancyOptimizer(fused AdamW) on the device path equals the host path; rank 1's inf is in its
    own holder (under ZeRO-2, its shard of the reduced gradient), so only the agreement skips the others."""
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]

    def body(path):
        rank = threadpar.get_rank()
        model = DistributedDataParallel(copy.deepcopy(template), bucket_cap_mb=0)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.05, fused=True)
        scaler = LossScaler(init_scale=2.0**4)
        skips = []
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(rank_slice(x, rank, 2)), rank_slice(y, rank, 2))
            scaler.scale_loss(loss).backward()
            holders = opt.grad_holders()
            if step == BAD_STEP and rank == BAD_RANK:
                next(h for h in holders if h.grad is not None).grad.view(-1)[0] = math.inf
            if path == "host":
                skips.append(not scaler.step(opt, holders))
            else:
                skips.append(bool(scaler.step_on_device(opt, holders)))
        return skips, scaler.scale, [p.detach().clone() for p in model.parameters()]

    host, device = run_ranks(body, 2, "host"), run_ranks(body, 2, "device")
    for (h_skips, h_scale, h_params), (d_skips, d_scale, d_params) in zip(host, device):
        assert h_skips == d_skips == [step == BAD_STEP for step in range(len(data))]
        assert h_scale == d_scale == 2.0**3
        for h, d in zip(h_params, d_params):
            torch.testing.assert_close(d, h)


# graphed ---------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("fake_mode")
def test_a_graphed_ddp_step_with_loss_scaling_equals_the_eager_one_with_an_overflow_in_a_replay():
    """fp32 parameters, the loss scaled (scaling needs no fp16); rank 1's batch at step 4 (a replay) makes an
    inf in the gradient of a parameter outside DDP (its own), so only the agreed flag skips rank 0. The
    graphed run (step_on_device) against the eager one (the host-branching step)."""
    world, warmup, steps, bad_step = 2, 2, 7, 4
    torch.manual_seed(0)
    template = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, 4 * world, 6, generator=g), torch.randn(steps, 4 * world, 3, generator=g)
    zs = torch.zeros(steps, world)
    zs[bad_step, BAD_RANK] = math.inf

    def run(graphed: bool):
        def body():
            rank, dev = threadpar.get_rank(), threadpar.get_device()
            model = DistributedDataParallel(copy.deepcopy(template).to(dev))
            local = torch.nn.Parameter(
                torch.ones((), device=dev)
            )  # (this rank's own: its gradient is not reduced)
            params = [*model.parameters(), local]
            opt = torch.optim.AdamW(params, lr=0.01, capturable=True, fused=True)
            scaler = LossScaler(init_scale=2.0**4, growth_interval=2)

            def train(x, y, z):
                opt.zero_grad(set_to_none=False)
                loss = torch.nn.functional.mse_loss(model(x), y) + local * z
                scaler.scale_loss(loss).backward()
                if graphed:
                    found = scaler.step_on_device(opt, params)
                else:
                    found = torch.tensor(float(not scaler.step(opt, params)))
                return loss.detach(), found

            step = threadpar.graphed_step(train, warmup_steps=warmup) if graphed else train
            out = []
            for i in range(steps):
                batch = (rank_slice(xs[i], rank, world), rank_slice(ys[i], rank, world), zs[i, rank])
                loss, found = step(*(t.to(dev) for t in batch))
                out.append(
                    (
                        loss.cpu(),
                        found.cpu(),
                        scaler.scale_tensor.cpu(),
                        [p.detach().cpu() for p in params],
                    )
                )
            return out, scaler.skipped_steps, step.replays if graphed else None

        fake = FakeCuda()
        results = run_fake_gpus(body, world, fake)
        assert fake.races == []
        return results

    for rank, ((g_out, g_skipped, replays), (e_out, e_skipped, _)) in enumerate(zip(run(True), run(False))):
        assert replays == steps - warmup
        assert g_skipped == e_skipped == 1
        for i, ((g_loss, g_found, g_scale, g_params), (e_loss, e_found, e_scale, e_params)) in enumerate(
            zip(g_out, e_out)
        ):
            torch.testing.assert_close(g_loss, e_loss)  # (rank 1's loss at bad_step: inf in both)
            assert float(g_found) == float(e_found) == float(i == bad_step)
            torch.testing.assert_close(g_scale, e_scale, rtol=0, atol=0)
            for gp, ep in zip(g_params, e_params):
                torch.testing.assert_close(gp, ep)
        # skipped in the replay on both ranks: nothing moved; 16 -> grows at steps 1, 3, halves at 4, grows at 6
        for before, after in zip(g_out[bad_step - 1][3], g_out[bad_step][3]):
            torch.testing.assert_close(after, before, rtol=0, atol=0)
        assert [float(o[2]) for o in g_out] == [16.0, 32.0, 32.0, 64.0, 32.0, 32.0, 64.0], rank


# the growth rule, refusals, state ------------------------------------------------------------------------------
class HostRule:
    """The rule LossScaler.update kept on the host before issue 33 (float64 scale, an unbounded good-step
    count grown on at each multiple of growth_interval)."""

    def __init__(self, scale: float, growth: float, backoff: float, interval: int) -> None:
        self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
        self.good = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.good = 0
            self.skipped += 1
            return
        self.good += 1
        if self.good % self.interval == 0:
            self.scale *= self.growth


@pytest.mark.parametrize(("growth", "backoff", "interval"), [(2.0, 0.5, 1), (2.0, 0.5, 3), (4.0, 0.25, 5)])
def test_the_device_update_keeps_the_host_rule(growth, backoff, interval):
    """torch._amp_update_scale_ (also through LossScaler.update with a bool and with a tensor) against the
    host rule over random overflow flags, overflow right after a growth included. Exact: powers of two."""
    rng = random.Random(interval)
    flags = [rng.random() < 0.3 for _ in range(60)] + [False] * interval + [True, True, False]

    def body():
        ref = HostRule(2.0**10, growth, backoff, interval)
        by_bool = LossScaler(
            init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
        )
        by_tensor = LossScaler(
            init_scale=2.0**10, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
        )
        scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
        for flag in flags:
            ref.update(flag)
            by_bool.update(flag)
            by_tensor.update(torch.tensor(float(flag)))
            torch._amp_update_scale_(scale, tracker, torch.tensor(float(flag)), growth, backoff, interval)
            for scaler in (by_bool, by_tensor):
                assert scaler.scale == ref.scale and scaler.skipped_steps == ref.skipped
                assert scaler.state_dict()["good_steps"] == ref.good % interval  # (reset at each growth)
            assert float(scale) == ref.scale and int(tracker) == ref.good % interval

    run_ranks(body, 1)


def test_the_device_path_refuses_an_optimizer_that_cannot_skip_on_the_device():
    def body(make):
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.ones(3)
        LossScaler().step_on_device(make([param]), [param])

    with pytest.raises(threadpar.ConfigError, match=r"SGD cannot skip a step on the device.*fused=True"):
        run_ranks(body, 2, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(threadpar.ConfigError, match=r"pass fused=True to ZeroRedundancyOptimizer.*AdamW"):
        run_ranks(body, 1, lambda ps: ZeroRedundancyOptimizer(ps, torch.optim.AdamW, process_group="DP"))


def test_the_state_round_trips_and_lives_on_the_device():
    def body():
        scaler = LossScaler(init_scale=2.0**5, growth_interval=3)
        for flag in (False, False, True, False, False):
            scaler.update(flag)
        state = scaler.state_dict()
        other = LossScaler(growth_interval=3)
        other.load_state_dict(state)
        old_style = LossScaler(growth_interval=3)  # (a state from before: good steps counted past growths)
        old_style.load_state_dict({"scale": 2.0**4, "good_steps": 8, "skipped_steps": 1})
        for scaler_ in (scaler, other, old_style):
            scaler_.update(False)  # the third good step since the last overflow or growth: grows
        return (
            state,
            scaler.state_dict(),
            other.state_dict(),
            old_style.state_dict(),
            scaler.scale_tensor.device,
        )

    for state, after, other, old_style, device in run_ranks(body, 1):
        assert state == {"scale": 16.0, "good_steps": 2, "skipped_steps": 1}
        assert after == other == old_style == {"scale": 32.0, "good_steps": 0, "skipped_steps": 1}
        assert device == torch.device("cpu")  # (the rank's device: cpu on CPU threads)
