"""Structures between pipeline stages, without threads: flatten/unflatten, packing into one message,
gradient messages, microbatch split and concatenation."""

import pytest
import torch

from threadpar.errors import ConfigError
from threadpar.pipeline.packing import (
    ALIGN,
    is_packed,
    pack,
    pack_gradients,
    unpack,
    unpack_gradients,
)
from threadpar.pipeline.structure import concat_microbatches, flatten, split_microbatches, unflatten

DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape) - 2.5
    if dtype is torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def test_flatten_and_unflatten_keep_the_structure_and_the_constants():
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    obj = {"x": (a, [b, None, 1.5]), "flag": True, "n": 7, "s": "text", "empty": ()}
    spec, leaves = flatten(obj, "test")
    assert leaves[0] is a and leaves[1] is b
    assert unflatten(spec, leaves) == obj
    rebuilt = unflatten(spec, leaves)
    assert type(rebuilt["x"]) is tuple and type(rebuilt["x"][1]) is list


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 1)])
def test_every_dtype_and_shape_round_trips_through_one_packed_message(shape):
    leaves = [sample(d, shape) for d in DTYPES]
    spec, flat = flatten({"t": tuple(leaves), "c": -1}, "test")
    flags = [d.is_floating_point for d in DTYPES]
    message = pack(spec, flat, flags, torch.device("cpu"))
    assert is_packed(message) and message.dtype is torch.uint8
    got_spec, got, got_flags = unpack(message.clone())  # a backend delivers its own copy
    assert got_spec == spec and got_flags == flags
    for leaf, back in zip(flat, got):
        assert back.dtype == leaf.dtype and back.shape == leaf.shape
        assert torch.equal(back, leaf)
        assert back.data_ptr() % ALIGN == message.data_ptr() % ALIGN  # every leaf starts aligned


def test_unpacked_leaves_are_independent_tensors_over_the_message_bytes():
    spec, flat = flatten((torch.ones(4), torch.full((4,), 2.0)), "test")
    message = pack(spec, flat, [True, True], torch.device("cpu"))
    _, (first, second), _ = unpack(message)
    assert first._base is None and second._base is None  # not autograd views: in-place ops are allowed
    first.add_(10)  # writes only its own bytes
    torch.testing.assert_close(second, torch.full((4,), 2.0))
    torch.testing.assert_close(unpack(message)[1][0], torch.full((4,), 11.0))  # no copy was made


def test_plain_tensors_never_look_packed_unless_shaped_like_a_packed_message():
    assert not is_packed(torch.zeros(1, 1, 1, 1, 1, 1, 1, 4))  # float
    assert not is_packed(torch.zeros(1, 1, 1, 1, 1, 1, 2, 4, dtype=torch.uint8))
    assert not is_packed(torch.zeros(16, dtype=torch.uint8))
    assert is_packed(torch.zeros(1, 1, 1, 1, 1, 1, 1, 4, dtype=torch.uint8))


def test_gradient_messages_for_one_several_and_missing_gradients():
    metas = [(torch.float32, (2, 3)), (torch.bfloat16, (4,)), (torch.float64, ())]
    grads = [sample(d, s) for d, s in metas]
    cpu = torch.device("cpu")
    for got, want in zip(unpack_gradients(pack_gradients(grads, metas, cpu).clone(), metas), grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    # one gradient travels as it is; a missing one among others arrives as zeros; none at all: empty
    assert pack_gradients(grads[:1], metas[:1], cpu) is grads[0]
    partial = unpack_gradients(pack_gradients([grads[0], None, grads[2]], metas, cpu), metas)
    torch.testing.assert_close(partial[1], torch.zeros(4, dtype=torch.bfloat16))
    torch.testing.assert_close(partial[2], grads[2])
    empty = pack_gradients([None, None, None], metas, cpu)
    assert empty.numel() == 0 and unpack_gradients(empty, metas) == [None, None, None]


def test_split_cuts_every_tensor_leaf_and_repeats_constants():
    batch = {"x": torch.arange(6).view(6, 1), "pair": (torch.arange(12).view(6, 2), 0.5)}
    pieces = split_microbatches(batch, 3, "inputs")
    assert len(pieces) == 3
    for m, piece in enumerate(pieces):
        torch.testing.assert_close(piece["x"], torch.arange(2 * m, 2 * m + 2).view(2, 1))
        torch.testing.assert_close(piece["pair"][0], torch.arange(4 * m, 4 * m + 4).view(2, 2))
        assert piece["pair"][1] == 0.5 and type(piece["pair"]) is tuple
    with pytest.raises(ConfigError, match=r"inputs\['pair'\]\[0\] has batch size 5 \(dim 0\), which must be"):
        split_microbatches({"x": torch.zeros(6), "pair": (torch.zeros(5), 1)}, 3, "inputs")


def test_concat_joins_tensor_leaves_stacks_scalars_and_lists_constants():
    outs = [{"y": torch.full((2, 3), float(m)), "aux": torch.tensor(float(m)), "k": m} for m in range(3)]
    joined = concat_microbatches(outs)
    assert joined["y"].shape == (6, 3) and joined["k"] == [0, 1, 2]
    torch.testing.assert_close(joined["aux"], torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ConfigError, match="microbatch 1 returned another structure"):
        concat_microbatches([(torch.ones(1),), (torch.ones(1), torch.ones(1))])


@pytest.mark.parametrize(
    "obj,message",
    [
        ((torch.ones(1), {1: 2}), r"where\[1\] is a dict with the key 1 \(int\)"),
        ([torch.ones(1), b"bytes"], r"where\[1\] is a builtins.bytes, which cannot travel"),
        ({"s": {torch.ones(1)}}, r"where\['s'\] is a builtins.set"),
    ],
)
def test_flatten_names_the_path_and_type_of_what_cannot_travel(obj, message):
    with pytest.raises(ConfigError, match=message):
        flatten(obj, "where")
