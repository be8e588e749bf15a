"""Zero-bubble plans as data (pure): W actions, the zbh1 and zb_interleaved generators, the simulator's F/B/W
costs and the memory a pending W keeps, and the errors for plans and sizes that cannot run."""

import pytest

from threadpar.errors import ConfigError
from threadpar.pipeline import (
    Action,
    Plan,
    ScheduleError,
    build_plan,
    get_stage_info,
    interleaved_1f1b,
    one_f_one_b,
    schedule_placement,
    simulate,
    zb_interleaved,
    zbh1,
    zbv,
)


def zero_bubble_plans(max_pp=6, max_v=3):
    for pp in range(1, max_pp + 1):
        for n in range(1, 3 * pp + 2):
            yield zbh1(pp, n)
            if n % pp == 0:
                for v in range(2, max_v + 1):
                    yield zb_interleaved(pp, n, v)
            if n >= 2 * pp - 1:
                yield zbv(pp, n)


def test_i_and_w_actions_have_a_string_form_and_mark_their_backward_as_split():
    w = Action.parse("3W12", rank=1)
    assert (w.chunk, w.microbatch, w.forward, w.weight, w.kind, str(w)) == (3, 12, False, True, "W", "3W12")
    i = Action.parse("3i12", rank=1)
    assert (i.kind, i.is_backward, i.accumulates, str(i)) == ("I", True, False, "3I12")
    assert Action.parse("0b1", rank=0).accumulates and Action(0, 0, 1, "F").forward
    plan = Plan.parse("r0: 0F0 0F1 0I0 0W0 0B1\nr1: 1F0 1B0 1F1 1I1 1W1")
    assert plan.split == {(0, 0), (1, 1)}  # 0B1 and 1B0 are full backwards: a B means one on its own
    assert not plan.forward_only and plan.forward_plan().split == frozenset()


def test_the_zero_bubble_grid_shows_w_in_its_own_steps():
    assert simulate(zbh1(2, 2)).grid() == (
        "zbh1: pp=2 n=2 v=1\n"
        "step   0    1    2    3    4    5    6\n"
        "r0    0F0  0F1   .   0I0  0W0  0I1  0W1\n"
        "r1     .   1F0  1I0  1F1  1I1  1W0  1W1"
    )


def test_every_zero_bubble_plan_is_deadlock_free_and_round_trips():
    count = 0
    for plan in zero_bubble_plans():
        sim = simulate(plan)
        assert sim.makespan > 0 and 0 <= sim.bubble < 1
        assert plan.split == {(c, m) for c in range(plan.num_chunks) for m in range(plan.n)}  # all split
        assert Plan.parse(str(plan)).actions == plan.actions
        count += 1
    assert count == 146  # 81 zbh1 + 26 zb_interleaved + 39 zbv


def test_zbh1_idles_a_third_of_1f1b_with_at_most_its_memory():
    """F = B = W: 1F1B's fused backward costs B + W. For n >= pp ZB-H1's idle time per rank is pp - 1 steps,
    a third of 1F1B's 3 (pp - 1); and no rank keeps more microbatches than 1F1B's first rank (pp)."""
    for pp in range(2, 7):
        for n in range(1, 3 * pp + 2):
            plain = simulate(one_f_one_b(pp, n), forward=1, backward=1, weight=1)
            zb = simulate(zbh1(pp, n), forward=1, backward=1, weight=1)
            work = 3 * n
            assert zb.makespan - work <= plain.makespan - work, (pp, n)
            if n >= pp:
                assert zb.makespan - work == pytest.approx((plain.makespan - work) / 3), (pp, n)
                assert zb.bubble == pytest.approx((pp - 1) / (3 * n + pp - 1))
            assert max(zb.peak_in_flight) == max(plain.peak_in_flight) == min(pp, n)
            # a W keeps its B's graph: rank r has at most r + 1 B's waiting for their W
            assert zb.peak_awaiting_weight == tuple(min(r + 1, n) for r in range(pp))


def test_zb_interleaved_has_less_bubble_than_interleaved_with_its_peak_memory():
    for pp in range(2, 6):
        for v in (2, 3):
            for n in range(pp, 3 * pp + 1, pp):
                costs = dict(forward=1 / v, backward=1 / v, weight=1 / v)
                plain = simulate(interleaved_1f1b(pp, n, v), **costs)
                zb = simulate(zb_interleaved(pp, n, v), **costs)
                assert zb.bubble < plain.bubble, (pp, v, n)
                assert max(zb.peak_in_flight) == max(plain.peak_in_flight), (pp, v, n)


def test_zbv_places_chunks_in_a_v_and_has_the_least_bubble():
    plan = zbv(4, 8)
    assert plan.placement == "v" and [plan.rank_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert Plan.parse(str(plan)).placement == "v"
    for pp in range(2, 6):
        for n in range(2 * pp - 1, 4 * pp):
            chunk_costs = dict(forward=0.5, backward=0.5, weight=0.5)  # a chunk is half a stage
            v_shape = simulate(zbv(pp, n), **chunk_costs)
            h1 = simulate(zbh1(pp, n), forward=1, backward=1, weight=1)
            assert v_shape.bubble < h1.bubble, (pp, n)
            # 2 pp half-stage activations at most: 1F1B's pp stage activations
            assert max(v_shape.peak_in_flight) == 2 * pp, (pp, n)


def test_the_v_placement_gives_rank_0_the_first_and_the_last_chunk():
    infos = [get_stage_info(16, 4, r, 2, placement="v") for r in range(4)]
    assert [i.chunk_ids for i in infos] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert infos[0].layer_ranges_per_chunk == ((0, 2), (14, 16))
    assert [(i.is_first_stage, i.is_last_stage) for i in infos] == [(True, True)] + [(False, False)] * 3
    assert schedule_placement("zbv") == "v" and schedule_placement("zbh1") == "loop"
    with pytest.raises(ConfigError, match="use 'loop', or 'v' with 2 chunks"):
        get_stage_info(16, 4, 0, 3, placement="v")


def test_a_fused_backward_costs_b_plus_w_and_a_split_one_each_part():
    mixed = Plan.parse("r0: 0F0 0I0 0W0 0F1 0B1")  # microbatch 0 split, microbatch 1 full
    sim = simulate(mixed, forward=1, backward=2, weight=3)
    assert sim.finish[0] == (1, 3, 6, 7, 12)
    assert simulate(mixed).finish[0] == (1, 2, 3, 4, 6)  # unit costs: each B, W and F one step
    assert simulate(one_f_one_b(2, 2), backward=2).makespan == 9  # no W's: backward is the whole one
    with pytest.raises(ConfigError, match="weight cost must be a non-negative number"):
        simulate(mixed, weight=-1)


def test_invalid_w_actions_are_rejected_with_the_reason():
    with pytest.raises(ScheduleError, match="the W comes before its I 0I0"):
        Plan.parse("r0: 0F0 0W0 0I0")
    with pytest.raises(ScheduleError, match=r"the W comes before its I 0I0 \(a W follows the I of a split"):
        Plan.parse("r0: 0F0 0B0 0W0")  # a B is a full backward: it leaves no W to do
    with pytest.raises(ScheduleError, match="0W0 appears twice"):
        Plan.parse("r0: 0F0 0I0 0W0 0W0")
    with pytest.raises(ScheduleError, match="0B0 is there already; a backward is either full"):
        Plan.parse("r0: 0F0 0B0 0I0 0W0")
    with pytest.raises(ScheduleError, match="misses 1 actions: r0:0W0"):
        Plan.parse("r0: 0F0 0I0")  # an I leaves its weight gradients to a W
    with pytest.raises(ScheduleError, match="chunk 1 runs on rank 1, not here"):
        Plan.parse("r0: 0F0 0I0 1W0\nr1: 1F0 1I0")
    with pytest.raises(ScheduleError, match="cannot parse action '0X1': write chunk, kind, microbatch"):
        Action.parse("0X1", rank=0)


def test_sizes_a_zero_bubble_schedule_cannot_run_raise_at_construction():
    with pytest.raises(
        ConfigError, match=r"'zbh1' runs one chunk per rank, but this rank has 2.*zb_interleaved"
    ):
        build_plan("zbh1", 2, 4, 2)
    with pytest.raises(ConfigError, match=r"'zb_interleaved' needs at least 2 chunks per rank.*'zbh1'"):
        build_plan("zb_interleaved", 2, 4, 1)
    # n < pp: interleaved zero bubble sends microbatches in groups of pp
    with pytest.raises(ConfigError, match="multiple of 4; got 2: use 4 or 4, or schedule='zbh1'"):
        build_plan("zb_interleaved", 4, 2, 2)
    with pytest.raises(ConfigError, match="num_microbatches must be a positive int"):
        build_plan("zbh1", 2, 0)
    with pytest.raises(ConfigError, match=r"'zbv' needs num_microbatches >= 2 \* pp - 1 = 7 .*got 3"):
        build_plan("zbv", 4, 3, 2)
    with pytest.raises(ConfigError, match="'zbv' runs exactly 2 chunks per rank"):
        build_plan("zbv", 4, 8, 1)
    assert build_plan("ZB-H1", 2, 2).actions == zbh1(2, 2).actions


def test_a_deadlocking_zero_bubble_plan_names_the_actions_that_wait_for_each_other():
    # Rank 0's I of microbatch 1 waits for rank 1's, which rank 1
    # runs only after its F of microbatch 2, which waits for rank 0's F of microbatch 2, queued after 0I1.
    plan = Plan.parse("r0: 0F0 0F1 0I0 0W0 0I1 0W1 0F2 0I2 0W2\nr1: 1F0 1I0 1W0 1F2 1F1 1I1 1W1 1I2 1W2")
    with pytest.raises(ScheduleError) as caught:
        simulate(plan)
    message = str(caught.value)
    assert "rank 0: 0I1 waits for 1I1 on rank 1" in message
    assert "rank 1: 1F2 waits for 0F2 on rank 0" in message
    assert "[0I1]" in message and "[1F2]" in message
    assert (
        "they wait for each other: 0I1 waits for 1I1, which rank 1 runs after its blocked 1F2; "
        "1F2 waits for 0F2, which rank 0 runs after its blocked 0I1"
    ) in message
