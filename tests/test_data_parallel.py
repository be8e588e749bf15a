"""DataParallel on CPU virtual devices: outputs and gradients equal to the plain module on the whole batch."""

import copy
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

from threadpar import ConfigError
from threadpar.parallel import DataParallel
from threadpar.parallel.scatter_gather import gather, scatter_kwargs

CPU = torch.device("cpu")
Pair = namedtuple("Pair", ["left", "right"])


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def data(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("devices", "rows"), [(2, 8), (3, 7), (4, 5), (4, 2)])
def test_outputs_and_gradients_equal_the_plain_module(devices, rows):
    plain, x = model(), data(rows)
    wrapped = copy.deepcopy(plain)
    x_plain, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    (plain(x_plain) ** 2).sum().backward()
    out = DataParallel(wrapped, device_ids=["cpu"] * devices)(x_dp)
    (out**2).sum().backward()
    torch.testing.assert_close(out, plain(x))
    torch.testing.assert_close(x_dp.grad, x_plain.grad)
    for p, q in zip(wrapped.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_uneven_batches_split_as_torch_chunk_does():
    x = torch.arange(5.0).view(5, 1)
    inputs, kwargs = scatter_kwargs((x,), {"flag": "keep"}, [CPU] * 4, dim=0)
    assert [a[0].shape[0] for a in inputs] == [2, 2, 1]  # x.chunk(4): three chunks, three replicas
    assert kwargs == [{"flag": "keep"}] * 3
    inputs, _ = scatter_kwargs((torch.zeros(2, 9),), {}, [CPU] * 3, dim=1)
    assert [a[0].shape for a in inputs] == [(2, 3)] * 3


class Nested(nn.Module):
    """Takes tensors inside a tuple, a list, a dict and keyword arguments; returns a dict and a namedtuple."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3).double()

    def forward(self, pair, items, mapping, *, scale, label):
        assert label == "constant"  # non-tensors reach every replica unchanged
        a = self.linear(pair[0]) + self.linear(items[1]) * mapping["w"]
        return {"out": a * scale, "both": Pair(a, pair[1] * 2), "none": None}


def test_nested_inputs_keyword_arguments_and_nested_outputs():
    plain = Nested()
    wrapped = copy.deepcopy(plain)
    x, y, z, w, s = (data(6, seed) for seed in range(5))
    args = ((x, y), [z, w], {"w": s[:, :1]})
    kwargs = {"scale": s[:, 1:4], "label": "constant"}
    expected = plain(*args, **kwargs)
    got = DataParallel(wrapped, device_ids=["cpu"] * 3)(*args, **kwargs)
    assert got["none"] is None and isinstance(got["both"], Pair)
    torch.testing.assert_close(got["out"], expected["out"])
    torch.testing.assert_close(got["both"].right, expected["both"].right)
    (expected["out"].sum() + expected["both"].left.sum()).backward()
    (got["out"].sum() + got["both"].left.sum()).backward()
    torch.testing.assert_close(wrapped.linear.weight.grad, plain.linear.weight.grad)


def test_scatter_and_gather_along_another_dim():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 2).double()

        def forward(self, x_t):  # x_t: [features, batch]
            return self.linear(x_t.t()).t()

    plain = Transposed()
    x_t = data(9).t()
    got = DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * 2, dim=1)(x_t)
    torch.testing.assert_close(got, plain(x_t))


class Recorder(nn.Module):
    """Records the thread, grad mode and autocast state each replica ran with."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 2)
        self.seen = []
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            self.seen.append(
                (threading.current_thread().name, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
            )
        return self.linear(x)


def test_replicas_run_on_their_own_threads_with_the_callers_grad_mode_and_autocast():
    recorder = Recorder()
    dp = DataParallel(recorder, device_ids=["cpu"] * 3)
    threads_before = torch.get_num_threads()
    x = data(6).float()
    out = dp(x)
    assert len({name for name, _, _ in recorder.seen}) == 3 and all(g and not a for _, g, a in recorder.seen)
    assert out.requires_grad
    recorder.seen.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(x)
    assert all(not g and a for _, g, a in recorder.seen) and len(recorder.seen) == 3
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    assert torch.get_num_threads() == threads_before  # the split of cores is undone after the forward


def test_buffers_are_updated_by_replica_zero_only():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5).double()
    plain = copy.deepcopy(bn)
    x = data(8)
    DataParallel(bn, device_ids=["cpu"] * 2)(x)
    plain(x[:4])  # replica 0's chunk
    torch.testing.assert_close(bn.running_mean, plain.running_mean)
    assert bn.num_batches_tracked.item() == 1


def test_shared_submodules_and_tied_weights_stay_shared_in_replicas():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(5, 5).double()
            self.b = self.a  # the same module twice

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    plain = Tied()
    wrapped = copy.deepcopy(plain)
    x = data(6)
    plain(x).sum().backward()
    DataParallel(wrapped, device_ids=["cpu"] * 3)(x).sum().backward()
    torch.testing.assert_close(wrapped.a.weight.grad, plain.a.weight.grad)


def test_scalar_outputs_become_a_vector_with_a_warning():
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(5, dtype=torch.float64))

        def forward(self, x):
            return (x * self.w).sum()

    x = data(6)
    with pytest.warns(UserWarning, match="returned scalars"):
        out = DataParallel(Loss(), device_ids=["cpu"] * 2)(x)
    torch.testing.assert_close(out, torch.stack([x[:3].sum(), x[3:].sum()]))


def test_a_replica_error_is_raised_in_the_caller_naming_the_replica():
    class FailsOnSmallBatches(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(5, 2).double()

        def forward(self, x):
            if x.shape[0] < 3:
                raise ValueError("batch too small")
            return self.linear(x)

    with pytest.raises(ValueError, match="batch too small") as info:
        DataParallel(FailsOnSmallBatches(), device_ids=["cpu"] * 3)(data(7))
    assert any("replica 2" in note for note in getattr(info.value, "__notes__", ["replica 2"]))


def test_single_device_and_no_inputs_just_call_the_module():
    plain = model()
    x = data(4)
    torch.testing.assert_close(DataParallel(plain, device_ids=["cpu"])(x), plain(x))
    torch.testing.assert_close(DataParallel(plain)(x), plain(x))  # no GPU here: one CPU device

    class Constant(nn.Module):
        def forward(self):
            return torch.ones(2)

    assert DataParallel(Constant(), device_ids=["cpu"] * 2)().tolist() == [1.0, 1.0]


def test_gather_walks_containers_and_rejects_mismatches():
    a, b = torch.zeros(1, 2), torch.ones(2, 2)
    assert gather([[a, "x"], [b, "y"]], CPU, 0)[1] == ["x", "y"]
    with pytest.raises(ConfigError, match="different keys"):
        gather([{"a": a}, {"b": b}], CPU, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"device_ids": [0]}, ConfigError, "not available"),
        ({"device_ids": 0}, ConfigError, "at least one device"),
        ({"device_ids": []}, ConfigError, "empty"),
        ({"device_ids": "cpu"}, ConfigError, "device_ids must be"),
        ({"device_ids": [1.5]}, ConfigError, "entries must be"),
        ({"dim": "0"}, ConfigError, "dim must be an int"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        DataParallel(model(), **kwargs)


def test_bad_inputs():
    dp = DataParallel(model(), device_ids=["cpu"] * 2)
    with pytest.raises(ConfigError, match="0-dim tensor"):
        dp(torch.tensor(1.0))
    with pytest.raises(ConfigError, match="dim=3 is out of range"):
        DataParallel(model(), device_ids=["cpu"] * 2, dim=3)(data(4))
    with pytest.raises(TypeError, match=r"wraps an nn\.Module"):
        DataParallel(lambda x: x)
