"""Context-parallel sequence layout: Megatron's padding rule, the load-balanced split, gathering it back."""

import itertools

import pytest
import torch

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import (
    gather_sequence,
    get_padding,
    load_balanced_indices,
    pad_sequence,
    restore_sequence_order,
    split_sequence,
)
from threadpar.parallel.context_parallel.sequence_shards import load_balanced_chunks
from threadpar.testing import run_ranks


def megatron_padding(seq_len, cp, tp, sp):
    """Megatron-core's get_padding, written as the seed describes it."""
    if sp and cp > 1:
        factor = tp * cp * 2
    elif cp > 1:
        factor = cp * 2
    elif sp:
        factor = tp
    else:
        factor = 1
    return (seq_len + factor - 1) // factor * factor - seq_len


@pytest.mark.parametrize(("cp", "tp", "sp"), list(itertools.product([1, 2, 4], [1, 2, 4], [False, True])))
def test_padding_matches_megatron_and_makes_the_length_splittable(cp, tp, sp):
    for seq_len in range(0, 40):
        pad = get_padding(seq_len, cp, tp, sp)
        assert pad == megatron_padding(seq_len, cp, tp, sp)
        total = seq_len + pad
        if cp > 1:
            assert total % (2 * cp) == 0
        if sp:
            assert (total // cp) % tp == 0  # each CP rank's part splits over its TP group


def test_padding_rejects_bad_sizes():
    with pytest.raises(ConfigError, match="cp_size must be a positive int"):
        get_padding(8, 0)
    with pytest.raises(ConfigError, match="seq_len must be a non-negative int"):
        get_padding(-1, 2)


def test_pad_sequence_appends_along_the_dim():
    x = torch.arange(6).view(2, 3)
    y = pad_sequence(x, 2, dim=1, value=-100)
    assert y.tolist() == [[0, 1, 2, -100, -100], [3, 4, 5, -100, -100]]
    assert pad_sequence(x, 0) is x


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_indices_cover_the_sequence_once_and_balance_causal_work(cp):
    seq_len = 8 * cp
    parts = [load_balanced_indices(seq_len, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
    for part in parts:
        assert (part.diff() > 0).all()  # local order is position order: a local causal mask is right
    # causal work of rank r = the number of (query, key <= query) pairs over the whole sequence
    work = [int((part + 1).sum()) for part in parts]
    assert len(set(work)) == 1, work
    assert load_balanced_chunks(2, 0) == (0, 3) and load_balanced_chunks(2, 1) == (1, 2)


def test_load_balanced_indices_need_a_padded_length():
    with pytest.raises(ConfigError, match="get_padding"):
        load_balanced_indices(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_then_gather_is_the_identity_and_matches_the_indices(cp):
    x = torch.randn(2, 8 * cp, 3, generator=torch.Generator().manual_seed(0))

    def body():
        group = threadpar.get_group("CP")
        local = split_sequence(x, dim=1)
        idx = load_balanced_indices(x.shape[1], cp, group.rank())
        torch.testing.assert_close(local, x[:, idx])
        torch.testing.assert_close(gather_sequence(local, dim=1), x)
        return local

    parts = run_ranks(body, cp, cp=cp)
    torch.testing.assert_close(restore_sequence_order(torch.cat(parts, dim=1), cp, dim=1), x)


def test_split_sequence_rejects_an_unpadded_length():
    def body():
        with pytest.raises(ConfigError, match=r"get_padding\(seq_len, cp_size=2\)"):
            split_sequence(torch.zeros(1, 10), dim=1)

    run_ranks(body, 2, cp=2)
