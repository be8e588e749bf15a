"""Schedules as data and the simulator (pure): golden plans, text round trips, properties on many sizes."""

import ast
import pathlib

import pytest

import threadpar.pipeline as pipeline
from threadpar.errors import ConfigError
from threadpar.pipeline import (
    Action,
    Plan,
    ScheduleError,
    afab,
    build_plan,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)


def all_plans(max_pp=6, max_v=4):
    """Every valid (schedule, pp, n, v) on small sizes."""
    for pp in range(1, max_pp + 1):
        for n in range(1, 3 * pp + 2):
            for v in range(1, max_v + 1):
                yield afab(pp, n, v)
            yield one_f_one_b(pp, n)
            if n % pp == 0:
                for v in range(2, max_v + 1):
                    yield interleaved_1f1b(pp, n, v)


# golden forms -------------------------------------------------------------------------------------------------
GOLDEN = {
    ("1f1b", 2, 3, 1): "r0: 0F0 0F1 0B0 0F2 0B1 0B2\nr1: 1F0 1B0 1F1 1B1 1F2 1B2",
    ("1f1b", 3, 2, 1): "r0: 0F0 0F1 0B0 0B1\nr1: 1F0 1F1 1B0 1B1\nr2: 2F0 2B0 2F1 2B1",
    ("afab", 2, 2, 1): "r0: 0F0 0F1 0B0 0B1\nr1: 1F0 1F1 1B0 1B1",
    ("afab", 2, 2, 2): "r0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\nr1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ("interleaved", 2, 2, 2): "r0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\nr1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ("interleaved", 2, 4, 2): (
        "r0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
        "r1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"
    ),
    # zero bubble: every backward split into I (input gradient) and W (weight gradient); zbv places chunks in a V (rank 0: chunks 0 and 3; rank 1: 1 and 2)
    ("zbh1", 2, 3, 1): "r0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\nr1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
    ("zb_interleaved", 2, 2, 2): (
        "r0: 0F0 0F1 2F0 2F1 2I0 2W0 2I1 2W1 0I0 0W0 0I1 0W1\n"
        "r1: 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1"
    ),
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2: rank 1 passes 1F to 2F itself
    ("zbv", 2, 3, 2): (
        "r0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2\n"
        "r1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2"
    ),
}


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: "-".join(map(str, k)))
def test_golden_string_forms(key):
    name, pp, n, v = key
    plan = build_plan(name, pp, n, v)
    assert str(plan) == GOLDEN[key]
    assert Plan.parse(GOLDEN[key]).actions == plan.actions


def test_golden_grid():
    assert simulate(one_f_one_b(2, 2)).grid() == (
        "1f1b: pp=2 n=2 v=1\n"
        "step   0    1    2    3    4    5\n"
        "r0    0F0  0F1   .   0B0   .   0B1\n"
        "r1     .   1F0  1B0  1F1  1B1   ."
    )


def test_action_string_form_and_parser():
    a = Action(rank=1, chunk=5, microbatch=12, kind="B")
    assert str(a) == "5B12"
    assert Action.parse("5B12", rank=1) == a
    assert Action.parse(" 0f3 ", rank=0) == Action(0, 0, 3, "F")
    assert a.local_chunk(pp=4) == 1
    # the lowered kinds, torch's names: a message per microbatch, a gradient synchronization per chunk
    for text in ("2SEND_F3", "2RECV_F3", "2SEND_B3", "2RECV_B3", "2SYNC_GRAD"):
        assert str(Action.parse(text, rank=0)) == text
    assert Action.parse("2sync_grad", rank=0).kind == "SYNC_GRAD"
    for bad in ("F3", "2SYNC_GRAD3", "2SEND_F", "2X3"):
        with pytest.raises(ScheduleError, match=f"cannot parse action '{bad}'"):
            Action.parse(bad, rank=0)
    with pytest.raises(ScheduleError, match="unknown action kind 'X'"):
        Action(0, 0, 0, "X")


def test_every_generated_plan_round_trips_through_text():
    for plan in all_plans(max_pp=4, max_v=3):
        parsed = Plan.parse(str(plan))
        assert (parsed.pp, parsed.n, parsed.v, parsed.actions) == (plan.pp, plan.n, plan.v, plan.actions)


# properties on many (pp, v, n) ----------------------------------------------------------------------------------
def test_every_generated_plan_runs_without_deadlock_and_keeps_bounded_memory():
    count = 0
    for plan in all_plans():
        sim = simulate(plan)
        assert sim.makespan > 0 and 0 <= sim.bubble < 1
        assert all(peak <= plan.n * plan.v for peak in sim.peak_in_flight)
        count += 1
    assert count > 400


def test_gpipe_takes_2_times_n_plus_chunks_minus_1_unit_steps():
    for pp in range(1, 7):
        for v in range(1, 4):
            for n in range(1, 3 * pp + 2):
                chunks = pp * v
                makespan = simulate(afab(pp, n, v)).makespan
                # The seed's table length 2(n + S*v - 1) is the time whenever a rank never needs two of its
                # chunks at one step: v = 1, or n <= S. Beyond that a rank's own work 2 n v dominates.
                if v == 1 or n <= pp:
                    assert makespan == 2 * (n + chunks - 1), (pp, v, n)
                assert makespan == 2 * max(n + chunks - 1, n * v + pp - 1), (pp, v, n)


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    for pp in range(1, 9):
        for n in range(1, 3 * pp + 2):
            sim = simulate(one_f_one_b(pp, n))
            assert sim.peak_in_flight == tuple(min(pp - r, n) for r in range(pp))
            assert simulate(afab(pp, n)).peak_in_flight == (n,) * pp  # AFAB keeps them all


@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2), (2, 1), (1, 3)])
def test_1f1b_and_gpipe_match_the_textbook_time_and_bubble(forward, backward):
    for pp in range(1, 7):
        for n in range(1, 3 * pp + 2):
            for plan in (one_f_one_b(pp, n), afab(pp, n)):
                sim = simulate(plan, forward=forward, backward=backward)
                assert sim.makespan == pytest.approx((n + pp - 1) * (forward + backward))
                assert sim.bubble == pytest.approx((pp - 1) / (n + pp - 1))


@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2)])
def test_interleaved_bubble_is_1_over_v_of_1f1b(forward, backward):
    for pp in range(2, 7):
        for v in range(2, 5):
            for n in range(pp, 4 * pp + 1, pp):
                # A chunk holds 1/v of a stage's layers: it costs 1/v of a stage.
                inter = simulate(interleaved_1f1b(pp, n, v), forward=forward / v, backward=backward / v)
                plain = simulate(one_f_one_b(pp, n), forward=forward, backward=backward)
                work = n * (forward + backward)
                assert inter.makespan - work == pytest.approx((plain.makespan - work) / v)
                assert inter.bubble == pytest.approx((pp - 1) / (v * n + pp - 1))
                assert inter.bubble < plain.bubble


def test_interleaved_warmup_sets_its_memory():
    for pp in range(1, 7):
        for v in range(2, 5):
            for n in range(pp, 3 * pp + 1, pp):
                peaks = simulate(interleaved_1f1b(pp, n, v)).peak_in_flight
                expected = [min(2 * (pp - r - 1) + (v - 1) * pp + 1, n * v) for r in range(pp)]
                assert list(peaks) == expected, (pp, v, n)


def test_costs_and_latency_shift_the_timing():
    sim = simulate(afab(2, 2), cost=lambda a: 3.0 if a.rank == 1 and not a.forward else 1.0)
    assert sim.busy == (4.0, 8.0)
    # r1 starts after 0F0 (t=1) and runs F, F, B, B (1 + 1 + 3 + 3); then r0's last backward (1)
    assert sim.makespan == 1 + 8 + 1
    assert simulate(afab(2, 1), latency=0.5).makespan == 4 + 2 * 0.5
    with pytest.raises(ConfigError, match="backward cost must be a non-negative number"):
        simulate(afab(2, 1), backward=-1)


# errors ---------------------------------------------------------------------------------------------------------
def test_microbatch_counts_a_schedule_cannot_run_raise_at_construction():
    with pytest.raises(ConfigError, match="num_microbatches must be a multiple of 4; got 6: use 4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ConfigError, match="multiple of 4; got 3: use 4 or 4"):
        build_plan("interleaved", 4, 3, 2)
    with pytest.raises(ConfigError, match="at least 2 chunks per rank"):
        interleaved_1f1b(4, 4, 1)
    with pytest.raises(ConfigError, match="'1f1b' runs one chunk per rank, but this rank has 2"):
        build_plan("1f1b", 2, 4, 2)
    with pytest.raises(ConfigError, match="num_microbatches must be a positive int, got 0"):
        build_plan("afab", 2, 0)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'"):
        build_plan("zb", 2, 4)
    assert build_plan("GPipe", 2, 2).actions == afab(2, 2).actions
    assert build_plan("interleaved-1f1b", 2, 2, 2).actions == interleaved_1f1b(2, 2, 2).actions


def test_invalid_plans_are_rejected_with_the_reason():
    with pytest.raises(ScheduleError, match="chunk 1 runs on rank 1, not here"):
        Plan.parse("r0: 0F0 1F0 0B0\nr1: 1B0")
    with pytest.raises(ScheduleError, match="the backward comes before its forward 0F0"):
        Plan.parse("r0: 0B0 0F0\nr1: 1F0 1B0")
    with pytest.raises(ScheduleError, match="0F0 appears twice"):
        Plan.parse("r0: 0F0 0F0 0B0\nr1: 1F0 1B0")
    with pytest.raises(ScheduleError, match=r"misses 1 actions: r1:1B0"):
        Plan.parse("r0: 0F0 0B0\nr1: 1F0")
    with pytest.raises(ScheduleError, match="must start with 'r1:'"):
        Plan.parse("r0: 0F0 0B0\nr2: 1F0 1B0")
    assert Plan.parse("r0: 0F0\nr1: 1F0").forward_only


def test_deadlock_is_found_and_shown_on_the_grid():
    # Rank 1 wants microbatch 1 first, but rank 0 first waits for the gradient of microbatch 0.
    plan = Plan.parse("r0: 0F0 0B0 0F1 0B1\nr1: 1F1 1F0 1B0 1B1")
    with pytest.raises(ScheduleError) as caught:
        simulate(plan)
    message = str(caught.value)
    assert "deadlocks" in message
    assert "rank 0: 0B0 waits for 1B0 on rank 1" in message
    assert "rank 1: 1F1 waits for 0F1 on rank 0" in message
    assert "[0B0]" in message and "[1F1]" in message and "blocked forever" in message


def test_error_grid_of_a_long_plan_shows_the_steps_around_the_mark():
    sim = simulate(one_f_one_b(4, 32))
    grid = sim.grid(mark=[(2, 30)], legend="[x] = here")
    assert "[2F16]" in grid or "[2B14]" in grid
    assert "(showing" in grid and len(grid.splitlines()[1].split()) <= 26


def test_pure_modules_import_no_torch_and_no_threads():
    allowed = {"__future__", "re", "collections.abc", "dataclasses", "threadpar.errors"}
    allowed |= {"threadpar.pipeline.schedule"}
    folder = pathlib.Path(pipeline.__file__).parent
    for name in ("partition.py", "schedule.py", "lowering.py", "simulator.py"):
        tree = ast.parse((folder / name).read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported <= allowed, (name, imported - allowed)
