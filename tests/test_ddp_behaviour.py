"""DistributedDataParallel beyond parity: bucket rebuild, launch during backward, bucket views, comm hooks,
wrong input, groups, backward on threads without a rank context, failures."""

import copy
import threading
import time

import pytest
import torch
from helpers.ddp_reference import DTYPE, assert_same, batches, grads_of, mlp, mse, rank_slice
from torch import nn

import threadpar
from threadpar import ConfigError
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.ddp import comm_hooks
from threadpar.testing import run_ranks

TINY_MB = 1e-4


class UsedInReverse(nn.Module):
    """Registered first, used last: the ready order differs from reverse registration order."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(4, 3)
        self.early = nn.Linear(6, 4)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def test_buckets_are_rebuilt_once_in_the_order_gradients_became_ready():
    torch.manual_seed(0)
    template = UsedInReverse().to(DTYPE)
    data = batches(steps=3, rows=4, n_in=6, n_out=3)
    reference = copy.deepcopy(template)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for x, y in data:
        optimizer.zero_grad()
        mse(reference, x, y).backward()
        expected.append(grads_of(reference))
        optimizer.step()

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        # Parameters: 0 late.weight, 1 late.bias, 2 early.weight, 3 early.bias; one per bucket.
        ddp = DistributedDataParallel(model, bucket_cap_mb=0, first_bucket_cap_mb=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        orders, grads = [ddp.reducer.bucket_indices()], []
        for x, y in data:
            optimizer.zero_grad()
            mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
            orders.append(ddp.reducer.bucket_indices())
            grads.append(grads_of(model))
            optimizer.step()
        return orders, grads

    for orders, grads in run_ranks(body, 2):
        assert orders[0] == [[3], [2], [1], [0]]  # reverse registration order
        assert orders[1] == [[1], [0], [3], [2]]  # late's gradients came first (bias before weight)
        assert orders[2] == orders[3] == orders[1]  # rebuilt once
        for step in range(3):
            assert_same(grads[step], expected[step], f"step {step} gradient")


def test_first_bucket_is_launched_before_backward_reaches_the_first_layer():
    template = mlp(widths=(6, 64, 64, 3))
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]
    events = []

    def recording_hook(group, bucket):
        events.append(f"bucket {bucket.index()}")
        return comm_hooks.allreduce_hook(group, bucket)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        if rank == 0:  # registered before DDP's hook, so it runs first
            model[0].weight.register_post_accumulate_grad_hook(lambda p: events.append("first layer ready"))
        ddp = DistributedDataParallel(model, bucket_cap_mb=0, first_bucket_cap_mb=0)
        if rank == 0:
            ddp.register_comm_hook(None, recording_hook)
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        return len(ddp.reducer.bucket_indices())

    n = run_ranks(body, 2)[0]
    assert n == 6
    # Buckets 0..4 were all-reduced while backward was still running; the last one holds the first layer.
    assert events.index("bucket 0") < events.index("first layer ready") < events.index(f"bucket {n - 1}")
    assert [e for e in events if e.startswith("bucket")] == [f"bucket {i}" for i in range(n)]


def test_the_last_bucket_is_reduced_on_the_backward_thread_after_the_others_overlapped():
    template = mlp(widths=(6, 64, 64, 3))
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0, first_bucket_cap_mb=0)
        backend = ddp.reducer._group._backend
        reduced_on, all_reduce = [], backend.all_reduce

        def recording(member, *args):
            if member == 0:  # the backend is shared by the group's members: record rank 0's calls
                reduced_on.append(threading.current_thread())
            return all_reduce(member, *args)

        if rank == 0:
            backend.all_reduce = recording
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        return threading.current_thread(), reduced_on

    rank_thread, reduced_on = run_ranks(body, 2)[0]
    assert len(reduced_on) == 6  # one all-reduce per bucket
    assert reduced_on[-1] is rank_thread  # the last bucket: at the end of backward, on the rank's own thread
    assert all(t.name.startswith("threadpar-comm") for t in reduced_on[:-1])  # the others overlapped


def test_gradients_are_views_into_the_buckets_even_after_set_to_none_and_rebuild():
    torch.manual_seed(0)
    template = UsedInReverse().to(DTYPE)
    data = batches(steps=3, rows=4, n_in=6, n_out=3)

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=TINY_MB)
        for step, (x, y) in enumerate(data):
            model.zero_grad(set_to_none=step == 1)
            mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
            buffers = ddp.reducer.bucket_buffers()
            for p in model.parameters():
                start = p.grad.data_ptr()
                assert any(
                    b.data_ptr() <= start < b.data_ptr() + b.numel() * b.element_size() for b in buffers
                )

    run_ranks(body, 2)


def test_without_bucketing_every_parameter_has_its_own_all_reduce():
    template = mlp()

    def body():
        ddp = DistributedDataParallel(copy.deepcopy(template), gradient_bucketing=False)
        return ddp.reducer.bucket_indices()

    assert run_ranks(body, 2)[0] == [[5], [4], [3], [2], [1], [0]]


def test_comm_hook_sees_buckets_in_order_with_their_parameters():
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]
    seen = []

    def hook(state, bucket):
        seen.append((state, bucket.index(), bucket.is_last(), len(bucket.parameters())))
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            assert g is p.grad  # no copies unless a hook asks for the flat buffer
        flat = torch.cat([g.reshape(-1) for g in bucket.gradients()])
        assert torch.equal(bucket.buffer(), flat) and bucket.buffer() is bucket.buffer()
        return comm_hooks.allreduce_hook(state["group"], bucket)

    def body():
        rank = threadpar.get_rank()
        ddp = DistributedDataParallel(
            copy.deepcopy(template), bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB
        )
        state = {"group": ddp.process_group}
        if rank == 0:
            ddp.register_comm_hook(state, hook)
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        return state

    state = run_ranks(body, 2)[0]
    assert [s[1] for s in seen] == [0, 1, 2] and [s[2] for s in seen] == [False, False, True]
    assert all(s[0] is state for s in seen) and sum(s[3] for s in seen) == 6


def test_a_comm_hook_returning_the_wrong_shape_is_reported():
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def bad_hook(group, bucket):
        future = torch.futures.Future()
        future.set_result(torch.zeros(1, dtype=DTYPE))
        return future

    def body():
        rank = threadpar.get_rank()
        ddp = DistributedDataParallel(copy.deepcopy(template))
        ddp.register_comm_hook(None, bad_hook)
        with pytest.raises(TypeError, match=r"comm hook's future for bucket 0 must hold a flat tensor of"):
            mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()

    run_ranks(body, 2)


def test_registering_a_comm_hook_twice_or_after_backward_is_refused():
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def body():
        rank = threadpar.get_rank()
        ddp = DistributedDataParallel(copy.deepcopy(template))
        with pytest.raises(TypeError, match="hook must be callable"):
            ddp.register_comm_hook(None, "allreduce")
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
        with pytest.raises(ConfigError, match="only once"):
            ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        other = DistributedDataParallel(copy.deepcopy(template))
        mse(other, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
        with pytest.raises(ConfigError, match="before the first backward"):
            other.register_comm_hook(None, comm_hooks.allreduce_hook)

    run_ranks(body, 2)


def test_unused_parameter_without_find_unused_parameters_names_it_and_the_fix():
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(6, 3)
            self.spare = nn.Linear(6, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    template = WithSpare().to(DTYPE)
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def body():
        rank = threadpar.get_rank()
        ddp = DistributedDataParallel(copy.deepcopy(template))
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()

    with pytest.raises(
        ConfigError,
        match=r"2 parameter\(s\) got no gradient.*'spare.weight', 'spare.bias'.*find_unused_parameters=True",
    ):
        run_ranks(body, 2)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: DistributedDataParallel("model"), TypeError, r"wraps an nn\.Module"),
        (
            lambda: DistributedDataParallel(nn.ReLU()),
            ConfigError,
            "at least one parameter that requires grad",
        ),
        (
            lambda: DistributedDataParallel(nn.Linear(2, 2), process_group=3),
            TypeError,
            "group must be None",
        ),
        (lambda: DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=-1), ConfigError, "bucket_cap_mb"),
        (
            lambda: DistributedDataParallel(nn.Linear(2, 2), broadcast_buffers="yes"),
            ConfigError,
            "broadcast_buffers",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(make, error, message):
    def body():
        with pytest.raises(error, match=message):
            make()

    run_ranks(body, 2)


def test_ranks_wrapping_different_models_are_told_so():
    def body():
        width = 3 + threadpar.get_rank()
        DistributedDataParallel(nn.Linear(2, width))

    with pytest.raises(ConfigError, match=r"wrapped modules with different parameters.*weight:\[[34], 2\]"):
        run_ranks(body, 2)


def test_groups_default_to_dp_and_can_be_named():
    def body():
        rank = threadpar.get_rank()
        default = DistributedDataParallel(nn.Linear(2, 2))
        by_name = DistributedDataParallel(nn.Linear(2, 2), process_group="DP")
        handle = threadpar.get_group("TP")
        explicit = DistributedDataParallel(nn.Linear(2, 2), process_group=handle)
        layout = threadpar.get_layout()
        assert default.process_group.ranks == tuple(layout.group_ranks("DP", rank))
        assert by_name.process_group is default.process_group
        assert explicit.process_group is handle

    run_ranks(body, 4, tp=2)


def test_with_context_parallelism_the_default_group_spans_dp_and_cp():
    def body():
        c = threadpar.get_coords()
        layout = threadpar.get_layout()
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        expected = sorted(layout.rank_of(dp=d, cp=k, tp=c.tp) for d in range(2) for k in range(2))
        assert list(ddp.process_group.ranks) == expected

    run_ranks(body, 8, tp=2, cp=2)


def test_a_group_of_one_rank_needs_no_reducer():
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def body():
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model)
        assert ddp.reducer is None
        with ddp.no_sync():
            assert not ddp.require_backward_grad_sync
            mse(ddp, x, y).backward()
        assert ddp.require_backward_grad_sync
        return grads_of(model)

    reference = copy.deepcopy(template)
    mse(reference, x, y).backward()
    assert_same(run_ranks(body, 2, tp=2)[0], grads_of(reference), "gradient")


def test_backward_on_a_thread_without_rank_context_still_synchronizes():
    """On CUDA, backward runs on PyTorch's device threads: the hooks must use only what they captured."""
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]
    reference = copy.deepcopy(template)
    mse(reference, x, y).backward()

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(model, bucket_cap_mb=TINY_MB)
        loss = mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2))
        failures = []

        def backward_elsewhere():
            try:
                assert not threadpar.in_rank()
                loss.backward()
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=backward_elsewhere)
        thread.start()
        thread.join()
        if failures:
            raise failures[0]
        return grads_of(model)

    for grads in run_ranks(body, 2):
        assert_same(grads, grads_of(reference), "gradient")


def test_a_failing_rank_stops_the_others_during_backward():
    template = mlp()
    x, y = batches(steps=1, rows=4, n_in=6, n_out=3)[0]

    def body():
        rank = threadpar.get_rank()
        ddp = DistributedDataParallel(copy.deepcopy(template), bucket_cap_mb=TINY_MB)
        if rank == 1:
            raise ValueError("rank 1 broke before its backward")
        mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(body, 2)
    assert time.monotonic() - start < 10  # not the collective timeout


class FailOnce(nn.Module):
    """Identity whose first backward raises, after the layers behind it have produced gradients."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, state):
            ctx.state = state
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if not ctx.state["failed"]:
                ctx.state["failed"] = True
                raise RuntimeError("backward failed once")
            return grad, None

    def __init__(self):
        super().__init__()
        self.state = {"failed": False}

    def forward(self, x):
        return FailOnce.Function.apply(x, self.state)


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_a_backward_that_failed_midway_does_not_break_the_next_one(view):
    torch.manual_seed(0)
    template = nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), FailOnce(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    template = template.to(DTYPE)
    data = batches(steps=2, rows=4, n_in=6, n_out=3)
    reference = copy.deepcopy(template)
    reference[2].state["failed"] = True
    mse(reference, *data[1]).backward()

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=0, first_bucket_cap_mb=0, gradient_as_bucket_view=view
        )
        x, y = (rank_slice(t, rank, 2) for t in data[0])
        with pytest.raises(RuntimeError, match="backward failed once"):
            mse(ddp, x, y).backward()  # the last layers' buckets were launched before the failure
        model.zero_grad()
        mse(ddp, *(rank_slice(t, rank, 2) for t in data[1])).backward()
        return grads_of(model)

    for grads in run_ranks(body, 2):
        assert_same(grads, grads_of(reference), "gradient")
