"""Zero-bubble schedules on the executor: I computes input gradients only, W the weight gradients later; the
loss and every gradient equal the single-thread model's (plain, DDP and structured messages)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.ddp_reference import DTYPE, batches, mse, rank_slice
from helpers.pipeline_models import MODELS
from helpers.pipeline_models import my_chunks as structured_chunks
from helpers.pipeline_models import my_gradients as structured_gradients
from helpers.pipeline_models import reference as structured_reference
from test_pipeline_executor import (
    assert_matches_reference,
    lm_loss,
    make_batch,
    make_model,
    my_chunks,
    my_gradients,
    reference,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import DistributedDataParallel
from threadpar.pipeline import PipelineParallel, Plan, build_chunks, build_plan, schedule_placement, simulate
from threadpar.testing import run_ranks

CASES = [
    # (schedule, pp, v, n): n < pp, n = pp, n >> pp
    *[("zbh1", pp, 1, n) for pp, n in [(2, 1), (2, 2), (2, 8), (4, 2), (4, 4), (4, 16), (4, 5)]],
    *[("zb_interleaved", pp, 2, n) for pp, n in [(2, 2), (2, 8), (4, 4), (4, 8)]],
    ("zb_interleaved", 1, 3, 2),  # one rank, three chunks
    # ZB-V: chunks in a V, n >= 2 pp - 1
    *[("zbv", pp, 2, n) for pp, n in [(1, 1), (2, 3), (2, 8), (4, 7), (4, 16)]],
]


@pytest.mark.parametrize("schedule,pp,v,n", CASES, ids=lambda x: str(x))
def test_zero_bubble_train_step_matches_the_whole_model_in_one_thread(schedule, pp, v, n):
    num_layers = pp * v + 3
    inputs, targets = make_batch(2 * n)
    ref_loss, ref_model = reference(num_layers, inputs, targets)
    expected_peaks = simulate(build_plan(schedule, pp, n, v)).peak_in_flight

    def body():
        model = make_model(num_layers)
        chunks = my_chunks(model, v, schedule_placement(schedule))
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=n)
        for _ in range(2):  # the second step accumulates onto the first: nothing left behind
            loss = pipe.train_step(inputs, targets)
        assert pipe.peak_saved_activations == expected_peaks[pipe.stage]  # a graph lives until its W
        return {"loss": loss, "grads": {k: g / 2 for k, g in my_gradients(model, chunks).items()}}

    assert_matches_reference(run_ranks(body, pp, pp=pp), ref_loss, ref_model)


def test_a_plan_mixing_split_and_fused_backwards_matches():
    inputs, targets = make_batch(6)
    ref_loss, ref_model = reference(5, inputs, targets)
    # microbatch 0 split on both ranks, microbatch 1 full on rank 0 only, microbatch 2 full everywhere
    plan = Plan.parse("r0: 0F0 0F1 0I0 0F2 0B1 0W0 0B2\nr1: 1F0 1I0 1F1 1I1 1W1 1F2 1B2 1W0")

    def body():
        model = make_model(5)
        chunks = my_chunks(model, 1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule=plan, num_microbatches=3)
        return {"loss": pipe.train_step(inputs, targets), "grads": my_gradients(model, chunks)}

    assert_matches_reference(run_ranks(body, 2, pp=2), ref_loss, ref_model)


class MatmulCounter(TorchDispatchMode):
    """Counts the matrix products this thread runs (dispatch modes are thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_i_computes_input_gradients_only_and_sends_them_before_w_runs():
    """On the middle stage of three (linear blocks without bias on 2-D activations): a fused backward runs
    two products per layer (dL/dx and dL/dW); I runs only dL/dx, W only dL/dW, and the gradient for the
    previous stage leaves right after I (SEND_B), before any weight gradient exists."""
    layers = 2

    def body():
        stage = threadpar.get_coords().pp
        g = torch.Generator().manual_seed(stage)
        chunk = nn.Sequential(*[nn.Linear(6, 6, bias=False) for _ in range(layers)])
        with torch.no_grad():
            for p in chunk.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        counts = {}
        pipe = PipelineParallel(chunk, loss_fn=F.mse_loss, schedule="zbh1", num_microbatches=2)
        run = pipe._backward_input, pipe._backward_weight

        def counted(kind, fn):
            def wrapper(action, *args):
                before = [None if p.grad is None else p.grad.clone() for p in chunk.parameters()]
                with MatmulCounter() as counter:
                    result = fn(action, *args)
                counts[f"{action}"] = counter.count
                if kind == "I":  # I leaves the weight gradients as they were
                    for p, old in zip(chunk.parameters(), before):
                        assert (p.grad is None and old is None) or torch.equal(p.grad, old)
                return result

            return wrapper

        pipe._backward_input, pipe._backward_weight = counted("I", run[0]), counted("W", run[1])
        pipe.train_step(torch.randn(4, 6), torch.randn(4, 6))
        return counts, [(e.name, e.category) for e in pipe.timeline.events]

    results = run_ranks(body, 3, pp=3)
    counts, events = results[1]
    assert counts == {"1I0": layers, "1I1": layers, "1W0": layers, "1W1": layers}
    # the send of dL/dx for microbatch 0 (message "0B0") is recorded in 1I0 (events end in order: send, 1I0)
    names = [name for name, _ in events]
    assert names.index("send 0B0") < names.index("1I0") < names.index("1W0")
    assert ("1W0", "weight") in events
    # Stage 0's input needs no gradient: its I has nothing to do, its W all of the backward (dL/dW of
    # both layers and the dL/dx between them: 2 layers - 1).
    assert results[0][0] == {"0I0": 0, "0I1": 0, "0W0": 2 * layers - 1, "0W1": 2 * layers - 1}


@pytest.mark.parametrize("schedule,v", [("zbh1", 1), ("zb_interleaved", 2), ("zbv", 2)])
def test_threadpar_ddp_chunks_in_a_dp_x_pp_zero_bubble_pipeline_match_one_thread(schedule, v):
    dp, pp, micro = 2, 2, 4
    g = torch.Generator().manual_seed(0)
    template = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(5)], nn.Linear(6, 3))
    template = template.to(DTYPE)
    with torch.no_grad():
        for p in template.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DTYPE) * 0.5)
    x, y = batches(steps=1, rows=dp * micro * 2, n_in=6, n_out=3)[0]
    ref = copy.deepcopy(template)
    mse(ref, x, y).backward()
    expected = {name: p.grad for name, p in ref.named_parameters()}

    def body():
        c = threadpar.get_coords()
        model = copy.deepcopy(template)
        layers = list(model)
        chunks = build_chunks(
            layers[:-1], pp_size=pp, pp_rank=c.pp, chunks_per_stage=v, last=layers[-1],
            placement=schedule_placement(schedule),
        )  # fmt: skip
        wrapped = [DistributedDataParallel(chunk, bucket_cap_mb=0, first_bucket_cap_mb=0) for chunk in chunks]
        pipe = PipelineParallel(wrapped, loss_fn=F.mse_loss, schedule=schedule, num_microbatches=micro)
        pipe.train_step(rank_slice(x, c.dp, dp), rank_slice(y, c.dp, dp))
        mine = {id(p) for chunk in chunks for p in chunk.parameters()}
        return {name: p.grad for name, p in model.named_parameters() if id(p) in mine}

    seen = {}
    for grads in run_ranks(body, dp * pp, pp=pp):
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")
            seen[name] = True
    assert seen.keys() == expected.keys()


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize(
    "schedule,pp,v,n", [("zbh1", 2, 1, 3), ("zbh1", 4, 1, 8), ("zb_interleaved", 2, 2, 4)]
)
def test_structured_messages_through_zero_bubble_schedules_match(kind, schedule, pp, v, n):
    make_layers, make_batch_of, loss_fn = MODELS[kind]
    num_blocks = pp * v + 1
    inputs, targets = make_batch_of(2 * n)
    ref_loss, ref_grads = structured_reference(kind, num_blocks, inputs, targets)

    def body():
        layers = make_layers(num_blocks)
        chunks = structured_chunks(layers, v, schedule_placement(schedule))
        pipe = PipelineParallel(chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=n)
        return {"loss": pipe.train_step(inputs, targets), "grads": structured_gradients(layers, chunks)}

    seen = {}
    for result in run_ranks(body, pp, pp=pp):
        torch.testing.assert_close(result["loss"], ref_loss)
        seen.update(result["grads"])
    assert seen.keys() == ref_grads.keys()
    for name, grad in seen.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")


def test_w_actions_on_a_chunk_without_weights_are_refused_at_construction():
    def body():
        stage = threadpar.get_coords().pp
        chunk = nn.ReLU() if stage == 0 else nn.Linear(2, 2)
        with pytest.raises(ConfigError, match=r"W actions .* for chunk 0 on stage 0, but that chunk has no"):
            if stage == 0:
                PipelineParallel(chunk, loss_fn=F.mse_loss, schedule="zbh1", num_microbatches=2)
            else:
                raise ConfigError("W actions (stand-in) for chunk 0 on stage 0, but that chunk has no")
        # a plan with full backwards for the weightless chunk and split ones for the other runs
        plan = Plan.parse("r0: 0F0 0F1 0B0 0B1\nr1: 1F0 1I0 1F1 1I1 1W0 1W1")
        pipe = PipelineParallel(chunk, loss_fn=F.mse_loss, schedule=plan, num_microbatches=2)
        return pipe.train_step(torch.ones(2, 2), torch.zeros(2, 2))

    losses = run_ranks(body, 2, pp=2)
    torch.testing.assert_close(losses[0], losses[1])
