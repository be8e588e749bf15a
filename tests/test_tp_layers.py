"""Column/row-parallel linear layers: parity with the dense model, options, errors, init and state dicts."""

import copy

import pytest
import torch
from helpers.tp_parity import (
    assert_grads_close,
    dense_mlp_block,
    grads_of,
    my_chunk,
    randn,
    seed_params_,
    tp_mlp_block,
)
from torch import nn

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    gather_dense_grads,
    gather_dense_state_dict,
    reduce_from_tp_region,
)
from threadpar.parallel.tensor_parallel.sharding import ShardSpec
from threadpar.testing import run_ranks

B, T, C, FFN = 2, 8, 16, 64


def dense_mlp():
    return dense_mlp_block(C, FFN)


def tp_mlp(dense, sp):
    return tp_mlp_block(dense, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_block_matches_dense_in_outputs_gradients_and_after_optimizer_steps(tp, sp):
    dense = dense_mlp()
    inputs = [randn(B, T, C, seed=10 + i) for i in range(3)]
    upstream = randn(B, T, C, seed=20)  # loss = sum(y * upstream)

    def run(model, x, w, steps, sync=lambda m: None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad()
            xi = x[step].clone().requires_grad_()
            y = model(xi)
            (y * w).sum().backward()
            sync(model)
            if step == 0:
                first = (y.detach(), xi.grad, grads_of(model))
            opt.step()
        return first

    want_y, want_xgrad, want_grads = run(copy.deepcopy(dense), inputs, upstream, 1)
    trained = copy.deepcopy(dense)
    run(trained, inputs, upstream, 3)

    def body():
        model = tp_mlp(dense, sp)
        split = (lambda t: my_chunk(t, 1)) if sp else (lambda t: t)
        y, x_grad, _ = run(
            model, [split(x) for x in inputs[:1]], split(upstream), 1, allreduce_sequence_parallel_grads
        )
        grads = gather_dense_grads(model)
        model = tp_mlp(dense, sp)
        run(model, [split(x) for x in inputs], split(upstream), 3, allreduce_sequence_parallel_grads)
        return y, x_grad, grads, gather_dense_state_dict(model)

    results = run_ranks(body, tp, tp=tp)
    join = (lambda ts: torch.cat(ts, dim=1)) if sp else (lambda ts: ts[0])
    torch.testing.assert_close(join([r[0] for r in results]), want_y)
    torch.testing.assert_close(join([r[1] for r in results]), want_xgrad)
    for r in results:
        assert_grads_close(r[2], want_grads)
        assert_grads_close(r[3], trained.state_dict())


def test_sequence_parallel_norm_gradients_are_wrong_without_the_sync():
    """The helper is what makes SP correct: without it each rank has only its sequence shard's LN gradient."""
    dense = dense_mlp()
    x, w = randn(B, T, C, seed=11), randn(B, T, C, seed=21)
    (dense(x) * w).sum().backward()

    def body():
        model = tp_mlp(dense, sp=True)
        (model(my_chunk(x, 1)) * my_chunk(w, 1)).sum().backward()
        return gather_dense_grads(model)

    for grads in run_ranks(body, 2, tp=2):
        torch.testing.assert_close(grads["fc1.weight"], dense.fc1.weight.grad)
        for name in ("ln.weight", "ln.bias", "fc2.bias"):
            assert not torch.allclose(grads[name], dense.get_parameter(name).grad), name


@pytest.mark.parametrize("tp", [2, 4])
def test_column_options_gather_skip_bias_and_shared_input(tp):
    head = seed_params_(nn.Linear(C, 10), seed=2)  # 10 outputs: padded for tp = 4
    q, k = seed_params_(nn.Linear(C, 8), seed=3), seed_params_(nn.Linear(C, 8), seed=4)
    x = randn(B, T, C, seed=12)
    xd = x.clone().requires_grad_()
    logits = head(xd)
    both = torch.cat([q(xd), k(xd)], -1)
    (logits.square().sum() + both.square().sum()).backward()

    def body():
        gathered = ColumnParallelLinear.from_dense(
            head, gather_output=True, pad_out_features_to_multiple_of=1
        )
        cq = ColumnParallelLinear.from_dense(q, input_is_parallel=True, skip_bias_add=True)
        ck = ColumnParallelLinear.from_dense(k, input_is_parallel=True)
        xi = x.clone().requires_grad_()
        out = gathered(xi)
        shared = copy_to_tp_region(xi)  # one all-reduce of the summed input gradient for both projections
        q_out, q_bias = cq(shared)
        k_out = ck(shared)
        local = (q_out + q_bias).square().sum() + k_out.square().sum()
        (out.square().sum() + reduce_from_tp_region(local)).backward()
        return (
            out.detach(),
            xi.grad,
            gather_dense_grads(gathered),
            gather_dense_grads(cq),
            gather_dense_grads(ck),
        )

    for out, x_grad, g_head, g_q, g_k in run_ranks(body, tp, tp=tp):
        torch.testing.assert_close(out, logits.detach())
        torch.testing.assert_close(x_grad, xd.grad)
        assert_grads_close(g_head, grads_of(head))
        assert_grads_close(g_q, grads_of(q))
        assert_grads_close(g_k, grads_of(k))


def test_row_options_scattered_input_and_unreduced_output():
    fc = seed_params_(nn.Linear(FFN, C), seed=5)
    x = randn(B, T, FFN, seed=13)
    xd = x.clone().requires_grad_()
    want = fc(xd)
    want.square().sum().backward()

    def body():
        scatter = RowParallelLinear.from_dense(fc, input_is_parallel=False)
        partial = RowParallelLinear.from_dense(fc, reduce_output=False, skip_bias_add=True)
        xi = x.clone().requires_grad_()
        y = scatter(xi)  # takes this rank's features of the whole input
        partial_y, bias = partial(my_chunk(x, -1))
        summed = reduce_from_tp_region(partial_y) + bias
        y.square().sum().backward()
        return y.detach(), summed.detach(), xi.grad, gather_dense_grads(scatter)

    for y, summed, x_grad, grads in run_ranks(body, 2, tp=2):
        torch.testing.assert_close(y, want.detach())
        torch.testing.assert_close(summed, want.detach())
        torch.testing.assert_close(x_grad, xd.grad)
        assert_grads_close(grads, grads_of(fc))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ColumnParallelLinear(8, 6),
            r"out_features=6 must be divisible by the TP size 4.*pad_out_features",
        ),
        (
            lambda: ColumnParallelLinear(8, 18, stride=3),
            r"out_features=18 must be divisible by the TP size 4 times stride 3",
        ),
        (lambda: RowParallelLinear(6, 8), r"in_features=6 must be divisible by the TP size 4"),
        (
            lambda: ColumnParallelLinear(8, 8, sequence_parallel=True, input_is_parallel=True),
            "Pass one of them",
        ),
        (lambda: ColumnParallelLinear(8, 8, gather_output=True, skip_bias_add=True), "skip_bias_add"),
        (lambda: RowParallelLinear(8, 8, reduce_output=False), "skip_bias_add=True"),
        (
            lambda: RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True),
            "input_is_parallel=True",
        ),
        (lambda: ColumnParallelLinear(0, 8), "in_features must be a positive int"),
        (lambda: VocabParallelEmbedding(10, 4, pad_vocab_to_multiple_of=0), "padding multiple"),
        (lambda: ColumnParallelLinear(8, 8, group="nonsense"), "unknown group|no group|nonsense"),
    ],
)
def test_bad_layer_arguments_raise_clear_errors(build, message):
    with pytest.raises(ConfigError, match=message):
        run_ranks(build, 4, tp=4)


def test_default_init_is_the_dense_init_split_at_any_tp_size():
    def body():
        model = nn.ModuleDict(
            {
                "qkv": ColumnParallelLinear(8, 24, stride=3),
                "proj": RowParallelLinear(8, 8),
                "emb": VocabParallelEmbedding(10, 8, padding_idx=3),
            }
        )
        return gather_dense_state_dict(model)

    ref = run_ranks(body, 1, seed=7)[0]
    assert ref["emb.weight"].shape == (10, 8) and (ref["emb.weight"][3] == 0).all()
    for tp in (2, 4):
        for state in run_ranks(body, tp, tp=tp, seed=7):
            assert_grads_close(state, ref, rtol=0, atol=0)
    other = run_ranks(body, 1, seed=8)[0]
    assert not torch.equal(other["qkv.weight"], ref["qkv.weight"])


def test_state_dicts_load_dense_or_local_and_gather_back_to_dense():
    dense = nn.ModuleDict({"fc1": nn.Linear(C, 12), "fc2": nn.Linear(12, C), "emb": nn.Embedding(13, C)})
    seed_params_(dense, seed=6)
    dense_state = dense.state_dict()

    def build(init):
        return nn.ModuleDict(
            {
                "fc1": ColumnParallelLinear(C, 12, device=None if init else "meta"),
                "fc2": RowParallelLinear(12, C),
                "emb": VocabParallelEmbedding(13, C, pad_vocab_to_multiple_of=2),
            }
        ).to_empty(device="cpu")

    def body():
        model = build(init=True)
        model.load_state_dict(dense_state)  # dense tensors are split on the way in
        local = copy.deepcopy(model)  # the copy shares the group handle
        again = build(init=True)
        again.load_state_dict(local.state_dict())  # tensors of the local shape load as they are
        return (
            gather_dense_state_dict(model),
            gather_dense_state_dict(again),
            local.fc1.group is model.fc1.group,
        )

    for from_dense, from_local, shared in run_ranks(body, 2, tp=2):
        assert shared
        assert_grads_close(from_dense, dense_state, rtol=0, atol=0)
        assert_grads_close(from_local, dense_state, rtol=0, atol=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_spec_splits_strided_and_padded_tensors_and_gathers_them_back(tp):
    full = torch.arange(30 * 2).reshape(30, 2)
    fused = ShardSpec(dim=0, size=24, padded=24, stride=3)  # three blocks of 8 rows, each split
    padded = ShardSpec(dim=1, size=30, padded=32)  # along dim 1, padded from 30 to 32

    def body():
        group = threadpar.get_group("TP")
        rank = group.rank()
        a = fused.shard(full[:24], rank, tp)
        b = padded.shard(full.T, rank, tp)
        return a, b, fused.gather(a, group), padded.gather(b, group)

    block = 8 // tp
    for rank, (a, b, dense_a, dense_b) in enumerate(run_ranks(body, tp, tp=tp)):
        rows = [s * 8 + rank * block + i for s in range(3) for i in range(block)]
        torch.testing.assert_close(a, full[rows])
        width = 32 // tp
        expected_b = torch.cat([full.T, full.T.new_zeros(2, 2)], dim=1)[:, rank * width : (rank + 1) * width]
        torch.testing.assert_close(b, expected_b)
        torch.testing.assert_close(dense_a, full[:24])
        torch.testing.assert_close(dense_b, full.T)
