"""The lowering pass (pure): every generated plan gets exactly the messages and gradient synchronizations
its compute actions need, in places that run when the compute plan runs; lowered text reads on its own."""

import pytest
from test_pipeline_schedule import all_plans
from test_pipeline_zero_bubble_schedule import zero_bubble_plans

from threadpar.pipeline import Plan, ScheduleError, lower, one_f_one_b, simulate, zbh1


def every_plan():
    yield from all_plans(max_pp=4, max_v=3)
    yield from zero_bubble_plans(max_pp=4, max_v=3)


def compute_times(sim):
    """Each compute action's (start, finish), by its text."""
    return {
        str(a): (sim.start[r][i], sim.finish[r][i])
        for r, row in enumerate(sim.plan.actions)
        for i, a in enumerate(row)
        if a.is_compute
    }


GOLDEN = {
    # 1F1B: a send after each F and B that has a neighbour, each receive posted one compute action ahead
    # (0RECV_B1 waits until 0F1 has run: whether a gradient comes back is known only then), and each chunk's
    # gradient synchronization right before its last backward.
    (one_f_one_b, 2, 2, True): (
        "r0: 0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0SYNC_GRAD 0B1\n"
        "r1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1SYNC_GRAD 1B1 1SEND_B1"
    ),
    (one_f_one_b, 2, 2, False): (
        "r0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0SYNC_GRAD 0B1\n"
        "r1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1SYNC_GRAD 1B1 1SEND_B1"
    ),
    # ZB-H1: the input half (I) sends the gradient upstream; the last W of a chunk synchronizes
    (zbh1, 2, 2, True): (
        "r0: 0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0I0 0RECV_B1 0W0 0I1 0SYNC_GRAD 0W1\n"
        "r1: 1RECV_F0 1F0 1RECV_F1 1I0 1SEND_B0 1F1 1I1 1SEND_B1 1W0 1SYNC_GRAD 1W1"
    ),
}


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: f"{k[0].__name__}-{k[1]}-{k[2]}-prefetch={k[3]}")
def test_golden_lowered_forms(key):
    schedule, pp, n, prefetch = key
    lowered = lower(schedule(pp, n), prefetch=prefetch)
    assert str(lowered) == GOLDEN[key]
    assert Plan.parse(GOLDEN[key]).actions == lowered.actions


def test_every_lowered_plan_is_valid_keeps_its_compute_order_and_runs_when_its_plan_runs():
    """Over the schedule grid: the lowered plan validates (every message once, on its chunk's rank, a
    receive before its consumer, a send after its producer, one SYNC_GRAD per chunk before its last
    gradient-accumulating action), reads back from its text, and the simulator gives every compute action
    the times it has in the compute plan, with and without latency: lowering adds no wait and no deadlock."""
    count = 0
    for plan in every_plan():
        for prefetch in (True, False):
            lowered = lower(plan, prefetch=prefetch)
            assert lowered.lowered and lowered.compute_plan().actions == plan.actions
            assert lower(lowered) is lowered
            assert Plan.parse(str(lowered)).actions == lowered.actions
            for latency in (0.0, 0.5):
                expected = compute_times(simulate(plan, latency=latency))
                assert compute_times(simulate(lowered, latency=latency)) == expected, (plan.name, prefetch)
            messages = sum(1 for row in lowered.actions for a in row if a.kind.startswith(("SEND", "RECV")))
            # two messages (a send and its receive) per chunk boundary, microbatch and direction
            assert messages == 2 * 2 * (plan.num_chunks - 1) * plan.n
            syncs = [a.chunk for row in lowered.actions for a in row if a.kind == "SYNC_GRAD"]
            assert sorted(syncs) == list(range(plan.num_chunks))
            count += 1
    assert count > 300


def test_prefetch_posts_each_receive_one_compute_action_ahead():
    for plan in every_plan():
        for prefetch in (True, False):
            for row in lower(plan, prefetch=prefetch).actions:
                compute = [a for a in row if a.is_compute]
                position = {a: i for i, a in enumerate(row)}
                for k, consumer in enumerate(compute):
                    wanted = "RECV_F" if consumer.forward else "RECV_B"
                    receive = next((a for a in row if a.kind == wanted and a.key == consumer.key), None)
                    if receive is None or consumer.weight:
                        continue
                    ahead = (
                        k > 0
                        and prefetch
                        and not (compute[k - 1].forward and compute[k - 1].key == consumer.key)
                    )
                    # the compute action the receive is posted before
                    target = compute[k - 1] if ahead else consumer
                    following = next(a for a in row[position[receive] :] if a.is_compute)
                    assert following == target, (plan.name, str(receive), prefetch)


def test_a_forward_plan_lowers_to_forward_messages_only():
    lowered = lower(one_f_one_b(3, 2).forward_plan())
    assert str(lowered) == (
        "r0: 0F0 0SEND_F0 0F1 0SEND_F1\n"
        "r1: 1RECV_F0 1RECV_F1 1F0 1SEND_F0 1F1 1SEND_F1\n"
        "r2: 2RECV_F0 2RECV_F1 2F0 2F1"
    )


@pytest.mark.parametrize(
    "text,reason",
    [
        (
            "r0: 0F0 0SEND_F0 0RECV_B0 0SYNC_GRAD 0B0\nr1: 1F0 1SYNC_GRAD 1B0 1SEND_B0",
            "misses the message 1RECV_F0 of 1F0",
        ),
        (
            "r0: 0SEND_F0 0F0 0RECV_B0 0SYNC_GRAD 0B0\nr1: 1RECV_F0 1F0 1SYNC_GRAD 1B0 1SEND_B0",
            "0SEND_F0 must come after 0F0 on rank 0",
        ),
        (
            "r0: 0F0 0SEND_F0 0RECV_B0 0SYNC_GRAD 0B0 0SEND_B0\nr1: 1RECV_F0 1F0 1SYNC_GRAD 1B0 1SEND_B0",
            "0SEND_B0 carries no message the compute actions need",
        ),
        (
            "r0: 0F0 0SEND_F0 0RECV_B0 0B0 0SYNC_GRAD\nr1: 1RECV_F0 1F0 1SYNC_GRAD 1B0 1SEND_B0",
            "0SYNC_GRAD must come right before the last action of chunk 0",
        ),
        (
            "r0: 0F0 0SEND_F0 0RECV_B0 0B0\nr1: 1RECV_F0 1F0 1SYNC_GRAD 1B0 1SEND_B0",
            "misses 0SYNC_GRAD",
        ),
        ("r0: 0F0 0SEND_F0 0SYNC_GRAD\nr1: 1RECV_F0 1F0", "forward only: it has no gradients to synchronize"),
    ],
)
def test_invalid_lowered_plans_are_rejected_with_the_reason(text, reason):
    with pytest.raises(ScheduleError, match=reason):
        Plan.parse(text)


def test_a_lowered_plan_that_deadlocks_is_found_by_the_simulator():
    # rank 1 receives microbatch 1 first, but rank 0 sends it only after the gradient of microbatch 0
    text = (
        "r0: 0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0SYNC_GRAD 0B1\n"
        "r1: 1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1SYNC_GRAD 1B1 1SEND_B1"
    )
    with pytest.raises(ScheduleError, match="rank 1: 1F1 waits for 0SEND_F1 on rank 0"):
        simulate(Plan.parse(text))
