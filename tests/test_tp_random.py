"""The TP random streams: which ranks share dropout masks, reproducibility, and the dropout itself."""

import pytest
import torch

import threadpar
from threadpar.errors import ConfigError
from threadpar.parallel import TrackedDropout, get_rng_tracker
from threadpar.parallel.tensor_parallel.random import INIT, REPLICATED, TP_REGION, dropout
from threadpar.testing import run_ranks


def masks_on_every_rank():
    """Two successive masks from a TP-region dropout and from a replicated one, and an INIT draw."""
    inside, outside = TrackedDropout(0.5, in_tp_region=True), TrackedDropout(0.5)
    ones = torch.ones(256)
    return {
        "inside": [inside(ones) != 0 for _ in range(2)],
        "outside": [outside(ones) != 0 for _ in range(2)],
        "init": torch.rand(8, generator=get_rng_tracker().generator(INIT)),
        "coords": threadpar.get_coords(),
    }


def test_dropout_differs_across_tp_ranks_inside_the_tp_region_and_agrees_outside():
    got = run_ranks(masks_on_every_rank, 4, tp=2, seed=3)  # ranks: (dp, tp) = (0,0) (0,1) (1,0) (1,1)
    assert [(r["coords"].dp, r["coords"].tp) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for call in range(2):
        inside = [r["inside"][call] for r in got]
        outside = [r["outside"][call] for r in got]
        # Inside the TP region: different across the TP group, identical across DP replicas.
        assert not torch.equal(inside[0], inside[1])
        assert torch.equal(inside[0], inside[2]) and torch.equal(inside[1], inside[3])
        # Outside: identical across the TP group (and here across DP replicas too).
        assert all(torch.equal(outside[0], m) for m in outside)
        assert not torch.equal(inside[0], outside[0])
    # Streams advance: the second mask is a new one.
    assert not torch.equal(got[0]["inside"][0], got[0]["inside"][1])
    assert not torch.equal(got[0]["outside"][0], got[0]["outside"][1])
    # INIT is shared by the TP group.
    assert all(torch.equal(got[0]["init"], r["init"]) for r in got)


def test_streams_repeat_with_the_launch_seed_and_change_with_it():
    a = run_ranks(masks_on_every_rank, 2, tp=2, seed=3)
    b = run_ranks(masks_on_every_rank, 2, tp=2, seed=3)
    c = run_ranks(masks_on_every_rank, 2, tp=2, seed=4)
    for r in range(2):
        assert torch.equal(a[r]["inside"][0], b[r]["inside"][0])
        assert torch.equal(a[r]["outside"][1], b[r]["outside"][1])
    assert not torch.equal(a[0]["inside"][0], c[0]["inside"][0])


def test_pipeline_stages_get_their_own_streams():
    got = run_ranks(masks_on_every_rank, 2, pp=2, seed=3)
    assert not torch.equal(got[0]["outside"][0], got[1]["outside"][0])


def test_dropout_scales_kept_values_and_passes_through_in_eval():
    def body():
        layer = TrackedDropout(0.25, in_tp_region=True)
        x = torch.full((20000,), 3.0, requires_grad=True)
        y = layer(x)
        y.sum().backward()
        layer.eval()
        return y.detach(), x.grad, layer(x) is x

    y, grad, passthrough = run_ranks(body, 1)[0]
    kept = y != 0
    assert 0.72 < kept.float().mean().item() < 0.78
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 4.0))  # 3 / (1 - 0.25)
    torch.testing.assert_close(grad, kept.float() / 0.75)
    assert passthrough


def test_tracker_state_round_trips_and_bad_probability_is_rejected():
    def body():
        gen = get_rng_tracker().generator(TP_REGION)
        state = get_rng_tracker().state_dict()
        first = dropout(torch.ones(64), 0.5, gen)
        get_rng_tracker().load_state_dict(state)
        again = dropout(torch.ones(64), 0.5, gen)
        assert get_rng_tracker().generator(REPLICATED) is not gen
        return torch.equal(first, again)

    assert run_ranks(body, 2, tp=2) == [True, True]
    with pytest.raises(ConfigError, match="between 0 and 1"):
        run_ranks(lambda: TrackedDropout(1.5), 1)
