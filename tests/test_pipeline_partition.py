"""get_stage_info (pure) and build_chunks."""

import itertools

import pytest
from torch import nn

from threadpar.errors import ConfigError
from threadpar.pipeline import build_chunks, chunk_layer_ranges, get_stage_info


def test_seed_example_72_layers_4_stages_2_chunks():
    expected = {
        0: [(0, 9), (36, 45)],
        1: [(9, 18), (45, 54)],
        2: [(18, 27), (54, 63)],
        3: [(27, 36), (63, 72)],
    }
    for rank, ranges in expected.items():
        info = get_stage_info(72, 4, rank, chunks_per_stage=2)
        assert list(info.layer_ranges_per_chunk) == ranges
        assert info.chunk_ids == (rank, rank + 4)
        assert info.is_first_stage == (rank == 0)
        assert info.is_last_stage == (rank == 3)


def test_remainder_layers_go_to_the_first_chunks():
    sizes = [get_stage_info(10, 3, r).num_layers for r in range(3)]
    assert sizes == [4, 3, 3]
    assert [b - a for a, b in chunk_layer_ranges(11, 8)] == [2, 2, 2, 1, 1, 1, 1, 1]


def test_every_layer_is_held_exactly_once_and_chunks_are_balanced():
    for pp, v in [(1, 1), (2, 1), (3, 1), (4, 2), (3, 3), (1, 4)]:
        for layers in range(pp * v, 30):
            held = {}
            for rank in range(pp):
                info = get_stage_info(layers, pp, rank, v)
                for chunk, (start, end) in zip(info.chunk_ids, info.layer_ranges_per_chunk):
                    assert chunk % pp == rank
                    held[chunk] = (start, end)
            ranges = [held[c] for c in range(pp * v)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # consecutive, no gaps
            sizes = [end - start for start, end in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_bad_arguments_say_what_to_fix():
    with pytest.raises(ConfigError, match=r"pp_rank=4 is outside 0..3"):
        get_stage_info(8, 4, 4)
    with pytest.raises(ConfigError, match=r"pp_rank=-1"):
        get_stage_info(8, 4, -1)
    with pytest.raises(ConfigError, match="3 layers cannot fill 4 pipeline chunks"):
        get_stage_info(3, 2, 0, chunks_per_stage=2)
    with pytest.raises(ConfigError, match="chunks_per_stage must be a positive int"):
        get_stage_info(8, 2, 0, chunks_per_stage=0)
    with pytest.raises(ConfigError, match="pp_size must be a positive int"):
        get_stage_info(8, 0, 0)


def test_build_chunks_puts_first_and_last_modules_on_the_end_stages():
    layers = [nn.Linear(2, 2) for _ in range(5)]
    embed, head = nn.Embedding(3, 2), nn.Linear(2, 3)
    rank0 = build_chunks(layers, pp_size=2, pp_rank=0, chunks_per_stage=2, first=embed, last=head)
    rank1 = build_chunks(layers, pp_size=2, pp_rank=1, chunks_per_stage=2, first=embed, last=head)
    # 5 layers on 4 chunks: 2, 1, 1, 1; chunk 0 and 2 on rank 0, chunk 1 and 3 on rank 1
    assert list(rank0[0]) == [embed, layers[0], layers[1]]
    assert list(rank0[1]) == [layers[3]]
    assert list(rank1[0]) == [layers[2]]
    assert list(rank1[1]) == [layers[4], head]
    with pytest.raises(ConfigError, match="sequence of layers"):
        build_chunks(nn.Linear(2, 2), pp_size=1, pp_rank=0)
