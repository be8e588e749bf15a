"""The pure bucket assignment (threadpar.parallel.ddp.bucketing) and the reducer's option checks."""

import itertools
import random

import pytest

from threadpar import ConfigError
from threadpar.parallel.ddp.bucketing import MIB, TensorSpec, assign_buckets, caps_in_bytes, rebuild_order
from threadpar.parallel.ddp.reducer import ReducerOptions


def specs(*nbytes, key="cpu/f32"):
    return [TensorSpec(n, key) for n in nbytes]


def test_reverse_order_by_default_and_first_bucket_capped_smaller():
    # Sizes 10 each; first cap 15, then 25: buckets close once they hold at least their cap.
    assert assign_buckets(specs(*[10] * 7), [15, 25]) == [[6, 5], [4, 3, 2], [1, 0]]


def test_caps_apply_per_key_and_keys_never_mix():
    sizes = [10, 10, 10, 10, 10, 10]
    keys = ["a", "b", "a", "b", "a", "b"]
    buckets = assign_buckets([TensorSpec(n, k) for n, k in zip(sizes, keys)], [20, 1000])
    assert buckets == [[5, 3], [4, 2], [1], [0]]
    for bucket in buckets:
        assert len({keys[i] for i in bucket}) == 1


def test_a_tensor_larger_than_the_cap_fills_a_bucket_alone_and_zero_cap_gives_one_each():
    assert assign_buckets(specs(5, 100, 5), [50]) == [[2, 1], [0]]
    assert assign_buckets(specs(5, 100, 5), [0]) == [[2], [1], [0]]


def test_explicit_order_and_buckets_sorted_by_their_first_tensor():
    order = [2, 0, 3, 1]
    buckets = assign_buckets([TensorSpec(10, k) for k in "abab"], [15], order=order)
    assert buckets == [[2, 0], [3, 1]]
    assert assign_buckets(specs(10, 10, 10, 10), [1000], order=order) == [order]


def test_every_index_once_and_launch_order_follows_visiting_order_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        sp = [TensorSpec(rng.randint(0, 40), rng.choice("xyz")) for _ in range(n)]
        order = rng.sample(range(n), n)
        caps = [rng.randint(0, 50) for _ in range(rng.randint(1, 3))]
        buckets = assign_buckets(sp, caps, order)
        flat = [i for b in buckets for i in b]
        assert sorted(flat) == list(range(n))
        position = {i: p for p, i in enumerate(order)}
        for b in buckets:  # within a bucket: visiting order, one key
            assert [position[i] for i in b] == sorted(position[i] for i in b)
            assert len({sp[i].key for i in b}) == 1
        firsts = [position[b[0]] for b in buckets]
        assert firsts == sorted(firsts)
        # Per key, every closed bucket except the key's last reaches its cap, and the level advances.
        for key in "xyz":
            mine = [b for b in buckets if sp[b[0]].key == key]
            for level, b in enumerate(mine[:-1]):
                cap = caps[min(level, len(caps) - 1)]
                total = sum(sp[i].nbytes for i in b)
                assert total >= cap and (len(b) == 1 or total - sp[b[-1]].nbytes < cap)


def test_rebuild_order_puts_never_ready_tensors_last_in_previous_order():
    assert rebuild_order([1, 3], previous=[3, 2, 1, 0], n=4) == [1, 3, 2, 0]
    assert rebuild_order([], previous=[0, 1], n=2) == [0, 1]
    with pytest.raises(ValueError, match="distinct"):
        rebuild_order([1, 1], previous=[0, 1], n=2)
    with pytest.raises(ValueError, match="permutation"):
        rebuild_order([0], previous=[0, 0], n=2)


def test_bad_order_and_caps_are_rejected():
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(specs(1, 2), [10], order=[0, 0])
    with pytest.raises(ValueError, match="caps"):
        assign_buckets(specs(1, 2), [])
    assert assign_buckets([], [10]) == []


def test_caps_in_bytes_and_options():
    assert caps_in_bytes(1, 25) == [MIB, 25 * MIB]
    assert ReducerOptions().caps == [MIB, 25 * MIB]
    assert ReducerOptions(gradient_bucketing=False).caps == [0]
    assert ReducerOptions(bucket_cap_mb=0.5, first_bucket_cap_mb=0).caps == [0, MIB // 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_cap_mb": -1}, "bucket_cap_mb must be a non-negative number"),
        ({"first_bucket_cap_mb": "1"}, "first_bucket_cap_mb must be a non-negative number"),
        ({"bucket_cap_mb": float("nan")}, "bucket_cap_mb"),
        ({"bucket_cap_mb": float("inf")}, "infinite"),
        ({"gradient_as_bucket_view": 1}, "gradient_as_bucket_view must be True or False"),
        ({"find_unused_parameters": None}, "find_unused_parameters must be True or False"),
    ],
)
def test_options_reject_bad_values_with_a_message(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ReducerOptions(**kwargs)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        ReducerOptions(25)  # type: ignore[misc]


def test_assignment_is_deterministic():
    sp = [TensorSpec(n, k) for n, k in zip([3, 8, 1, 9, 4], itertools.cycle("ab"))]
    assert assign_buckets(sp, [5, 9]) == assign_buckets(list(sp), [5, 9])
