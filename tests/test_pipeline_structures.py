"""PipelineParallel with chunks that pass several tensors (tuples, dicts): parity with the whole model in
one thread, gradients only where they belong, one message per hop, and clear errors for what cannot travel."""

from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn.functional as F
from helpers.pipeline_models import (
    DIM,
    MODELS,
    SEQ,
    VOCAB,
    Chain,
    dict_batch,
    dict_layers,
    dict_loss,
    my_chunks,
    my_gradients,
    reference,
    tuple_batch,
    tuple_layers,
    tuple_loss,
)
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.pipeline import PipelineParallel, build_plan, simulate
from threadpar.pipeline.structure import call_chunk
from threadpar.testing import run_ranks

CASES = [
    # (schedule, pp, v, n)
    ("afab", 2, 1, 4),
    ("1f1b", 2, 1, 3),
    ("interleaved", 2, 2, 4),
    ("afab", 4, 1, 4),
    ("1f1b", 4, 1, 8),
    ("interleaved", 4, 2, 4),
]


def assert_parity(results, ref_loss, ref_grads):
    seen = {}
    for result in results:
        torch.testing.assert_close(result["loss"], ref_loss)  # every stage reports the mean loss
        seen.update(result["grads"])
    assert seen.keys() == ref_grads.keys()  # every parameter is held by exactly one stage
    for name, grad in seen.items():
        assert grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("schedule,pp,v,n", CASES, ids=lambda x: str(x))
def test_train_step_with_several_tensors_between_stages_matches_the_whole_model(kind, schedule, pp, v, n):
    make_layers, make_batch, loss_fn = MODELS[kind]
    num_blocks = pp * v + 1
    inputs, targets = make_batch(2 * n)
    ref_loss, ref_grads = reference(kind, num_blocks, inputs, targets)
    expected_peaks = simulate(build_plan(schedule, pp, n, v)).peak_in_flight

    def body():
        layers = make_layers(num_blocks)
        chunks = my_chunks(layers, v)
        pipe = PipelineParallel(chunks, loss_fn=loss_fn, schedule=schedule, num_microbatches=n)
        loss = pipe.train_step(inputs, targets)
        assert pipe.peak_saved_activations == expected_peaks[pipe.stage]
        # one message per hop, each way: n activations out per chunk that sends, n gradients back
        sends = [e.name for e in pipe.timeline.events if e.category == "send"]
        senders = sum(1 for c in range(pipe.stage, pp * v - 1, pp))  # chunks of this rank with a successor
        receivers = sum(1 for c in range(pipe.stage, pp * v, pp) if c > 0)
        assert len(sends) == n * (senders + receivers), sends
        return {"loss": loss, "grads": my_gradients(layers, chunks)}

    assert_parity(run_ranks(body, pp, pp=pp), ref_loss, ref_grads)


def test_gradients_reach_only_floating_leaves_that_require_grad():
    """In the tuple model the bf16 residual carries a gradient, the int mask and the gate (which only feeds
    a comparison) carry none: their gradients, seen on the sending side, say so."""
    inputs, targets = tuple_batch(4)
    seen = {}

    def body():
        layers = tuple_layers(2)
        chunks = my_chunks(layers, 1)
        if threadpar.get_coords().pp == 0:
            embed = chunks[0].layers[-1]  # the last block of stage 0: its outputs cross to stage 1

            def record(module, args, output):
                for name, leaf in zip(("hidden", "mask", "gate", "residual"), output):
                    if leaf.requires_grad:
                        leaf.register_hook(lambda g, name=name: seen.setdefault(name, g))

            embed.register_forward_hook(record)
        pipe = PipelineParallel(chunks, loss_fn=tuple_loss, num_microbatches=2)
        pipe.train_step(inputs, targets)

    run_ranks(body, 2, pp=2)
    assert set(seen) == {"hidden", "gate", "residual"}  # the mask is an integer: not differentiable
    assert seen["residual"].dtype == torch.bfloat16 and seen["residual"].abs().sum() > 0
    assert seen["hidden"].abs().sum() > 0
    assert torch.count_nonzero(seen["gate"]) == 0  # it feeds a comparison only: its gradient is zero


@pytest.mark.parametrize("plain", [False, True], ids=["tuple", "plain"])
def test_a_chunk_whose_backward_never_reaches_its_input_settles_with_no_gradient(plain):
    """Stage 1 uses only the integer leaf of what stage 0 sends (or, for a plain activation, its value
    detached): no gradient reaches stage 0, and neither stage waits for one (two steps: a message left
    behind would also break the second)."""

    class Stage0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(DIM, DIM)

        def forward(self, x):
            y = self.linear(x)
            return y if plain else (y, x.argmax(-1))  # float requiring grad (, int64)

    class Stage1(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(DIM, 1)

        def forward(self, hidden, index=None):
            if plain:
                index = hidden.detach().argmax(-1)
            return self.embedding(index)[:, 0]  # [b]: no gradient flows into hidden

    x, y = torch.randn(8, DIM), torch.randn(8)

    def body():
        stage = threadpar.get_coords().pp
        chunk = Stage0() if stage == 0 else Stage1()
        pipe = PipelineParallel(chunk, loss_fn=F.mse_loss, num_microbatches=4, group="PP")
        for _ in range(2):
            pipe.train_step(x, y)
        return [p.grad for p in chunk.parameters()]

    stage0, stage1 = run_ranks(body, 2, pp=2, timeout=10)
    assert stage0 == [None, None]
    assert stage1[0] is not None and stage1[0].abs().sum() > 0


def test_integer_activations_between_stages_train_without_waiting_for_a_gradient():
    """A plain int64 activation (token ids from a chunk without parameters): no gradient goes back."""

    class Shift(nn.Module):
        def forward(self, ids):
            return (ids + 1) % VOCAB

    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    ids, labels = torch.randint(VOCAB, (4, SEQ)), torch.randint(VOCAB, (4, SEQ))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    expected = loss_fn(model(Shift()(ids)), labels)
    expected.backward()

    def body():
        replica = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
        replica.load_state_dict(model.state_dict())
        chunk = Shift() if threadpar.get_coords().pp == 0 else replica
        pipe = PipelineParallel(chunk, loss_fn=loss_fn, num_microbatches=2)
        return pipe.train_step(ids, labels), [p.grad for p in chunk.parameters()]

    (loss, _), (_, grads) = run_ranks(body, 2, pp=2, timeout=20)
    torch.testing.assert_close(loss, expected.detach())
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_eval_step_concatenates_structured_outputs():
    inputs, _ = dict_batch(6)
    layers = dict_layers(6)
    # per microbatch of 2 rows: the aux loss is a 0-dim tensor per microbatch, stacked into [3]
    expected = [call_chunk(Chain(layers), {k: v[m : m + 2] for k, v in inputs.items()}) for m in (0, 2, 4)]

    def body():
        pipe = PipelineParallel(
            my_chunks(dict_layers(6), 2), loss_fn=dict_loss, schedule="interleaved", num_microbatches=3
        )
        return pipe.eval_step(inputs)

    outputs = run_ranks(body, 3, pp=3)
    assert outputs[0] is None and outputs[1] is None
    got = outputs[2]
    assert set(got) == {"logits", "aux"}
    torch.testing.assert_close(got["logits"], torch.cat([e["logits"] for e in expected]).detach())
    torch.testing.assert_close(got["aux"], torch.stack([e["aux"] for e in expected]).detach())
    assert not got["logits"].requires_grad


def test_tuple_inputs_and_targets_are_split_leaf_by_leaf():
    (ids, keep), (labels, weights) = tuple_batch(6)
    ref_loss, ref_grads = reference("tuple", 3, (ids, keep), (labels, weights))

    def body():
        layers = tuple_layers(3)
        chunks = my_chunks(layers, 1)
        pipe = PipelineParallel(chunks, loss_fn=tuple_loss, num_microbatches=3)
        # lists work as tuples do; the other stages may pass anything (here: nothing)
        stage = threadpar.get_coords().pp
        loss = pipe.train_step([ids, keep] if stage == 0 else None, [labels, weights] if stage == 1 else None)
        return {"loss": loss, "grads": my_gradients(layers, chunks)}

    assert_parity(run_ranks(body, 2, pp=2), ref_loss, ref_grads)


Point = namedtuple("Point", "x y")


class Returns(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.make = make

    def forward(self, *args, **kwargs):
        return self.make(self.linear(torch.ones(4, 2)))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda y: (y, object()), r"the output of chunk 0\[1\] is a builtins.object, which cannot travel"),
        (lambda y: {"h": [y, {3: y}]}, r"the output of chunk 0\['h'\]\[1\] is a dict with the key 3 \(int\)"),
        (lambda y: Point(y, y), r"chunk 0 is a .*Point.*convert it to a plain tuple or dict"),
        (lambda y: OrderedDict(h=y), r"chunk 0 is a collections.OrderedDict.*plain tuple or dict"),
        (lambda y: (y, y.to_sparse()), r"chunk 0\[1\] is a torch.sparse_coo tensor.*to_dense"),
    ],
)
def test_an_output_that_cannot_travel_is_refused_with_its_path(make, message):
    def body():
        stage = threadpar.get_coords().pp
        chunk = Returns(make) if stage == 0 else nn.Identity()
        pipe = PipelineParallel(chunk, loss_fn=lambda y, t: y[0].sum(), num_microbatches=2)
        pipe.train_step(torch.zeros(4, 2), torch.zeros(4, 2))

    with pytest.raises(ConfigError, match=message) as caught:
        run_ranks(body, 2, pp=2, timeout=20)
    assert "in action 0SEND_F0" in "\n".join(caught.value.__notes__)  # the send, shown like any failure


def test_inputs_and_targets_whose_leaves_do_not_divide_are_refused_with_their_path():
    def body():
        pipe = PipelineParallel(nn.Linear(2, 2), loss_fn=F.mse_loss, num_microbatches=2)
        stage = threadpar.get_coords().pp
        if stage == 0:  # these fail before any message is sent
            with pytest.raises(ConfigError, match=r"inputs\['mask'\] has batch size 3 \(dim 0\)"):
                pipe.train_step({"x": torch.zeros(4, 2), "mask": torch.zeros(3)})
            with pytest.raises(ConfigError, match=r"inputs\[1\] has batch size no \(dim 0\)"):
                pipe.train_step((torch.zeros(4, 2), torch.tensor(1.0)))
            with pytest.raises(TypeError, match=r"first stage needs inputs as a tensor .* got tuple without"):
                pipe.train_step((1, None))
        else:
            with pytest.raises(ConfigError, match=r"targets\[0\]\['y'\] has batch size 5"):
                pipe.train_step(None, [{"y": torch.zeros(5)}])

    run_ranks(body, 2, pp=2)
