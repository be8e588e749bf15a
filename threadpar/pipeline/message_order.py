"""The order in which each stage launches its messages on a transport where a send waits for its receive (pure).

On nccl a pipeline's messages go over the PP group's own communicator (pipeline/transport.py), where NCCL runs
a communicator's launches one after another on the device (src/enqueue.cc, ncclLaunchPrepare) and a send
completes only once its receive runs ("blocking for the GPU", nccl.h). So the order in which a stage
launches its sends and receives decides whether the step can finish: two stages that each launch a send to
the other before the matching receive wait for each other for ever, though the same plan runs on a buffered
transport (the simulator's model).

`launch_orders(plan)` gives every stage one order that cannot deadlock: all messages sorted by one global key,
the time its sender finishes producing it in the plan's simulation (unit costs; ties by sender, then its
action), and each stage launches the messages it sends or receives in that order. Why that cannot deadlock,
by induction on the key: the earliest message not yet transferred is, on both of its stages, the next launch
(every earlier launch of either is an earlier message, transferred); its receive needs nothing; its send needs
its producer, a compute action whose inputs arrived before it started, so were sent before it finished: earlier
keys, already there. And it can be followed in program order: a stage's sends come in key order (its compute
actions finish in order), and a receive's key is at most the start of the action that consumes it, so it is
launched in time if it is launched once every earlier send of its stage is (the transport pulls receives
forward to that point; it never has to push a send). Grouping consecutive launches of a stage in one NCCL
group only lets more run at once.

`check_launch_orders(plan, orders)` replays the orders on that model (a stage's compute in plan order, its
launches in order on one lane, a send launch completing with its receive's) and raises ScheduleError naming
the messages that wait for each other; tests run it over every schedule's grid.
"""

from __future__ import annotations

from typing import NamedTuple

from threadpar.pipeline.p2p import describe_tag, message_tag
from threadpar.pipeline.schedule import Action, Plan, ScheduleError
from threadpar.pipeline.simulator import simulate


class Message(NamedTuple):
    """One pipeline message as a stage launches it."""

    send: bool  # this stage sends it (else receives it)
    peer: int  # the other stage
    tag: int  # message_tag(microbatch, chunk, backward)

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {describe_tag(self.tag)} {'to' if self.send else 'from'} stage {self.peer}"


def produced(plan: Plan, action: Action) -> tuple[int, int] | None:
    """(destination chunk, tag) of the message a compute action produces, or None."""
    if action.forward and action.chunk < plan.num_chunks - 1:
        return action.chunk + 1, message_tag(action.microbatch, action.chunk, False)
    if action.is_backward and action.chunk > 0:
        return action.chunk - 1, message_tag(action.microbatch, action.chunk - 1, True)
    return None


def consumed(plan: Plan, action: Action) -> tuple[int, int] | None:
    """(source chunk, tag) of the message a compute action consumes, or None."""
    if action.forward and action.chunk > 0:
        return action.chunk - 1, message_tag(action.microbatch, action.chunk - 1, False)
    if action.is_backward and action.chunk < plan.num_chunks - 1:
        return action.chunk + 1, message_tag(action.microbatch, action.chunk, True)
    return None


def launch_orders(plan: Plan) -> tuple[tuple[Message, ...], ...]:
    """Per stage, the messages it exchanges with other stages, in launch order (module docstring). Messages
    between two chunks of one stage stay on it (its local channel) and are left out."""
    compute = plan.compute_plan()
    simulation = simulate(compute)
    keyed = []
    for stage, row in enumerate(compute.actions):
        for i, action in enumerate(row):
            out = produced(compute, action)
            if out is None:
                continue
            dst = compute.rank_of(out[0])
            if dst != stage:
                keyed.append(((simulation.finish[stage][i], stage, i), stage, dst, out[1]))
    orders: list[list[Message]] = [[] for _ in range(compute.pp)]
    for _, src, dst, tag in sorted(keyed):
        orders[src].append(Message(True, dst, tag))
        orders[dst].append(Message(False, src, tag))
    return tuple(tuple(order) for order in orders)


def check_launch_orders(plan: Plan, orders: tuple[tuple[Message, ...], ...]) -> None:
    """Replay `orders` on NCCL's model (module docstring): raise ScheduleError if the step could not finish."""
    compute = plan.compute_plan()
    pp = compute.pp
    rows = compute.actions
    pos, lane = [0] * pp, [0] * pp  # next compute action, next launch, per stage
    done_compute: set[tuple[int, int]] = set()  # (stage, index) of finished compute actions
    arrived: set[tuple[int, int]] = set()  # (receiving stage, tag) of messages transferred (or local)
    producer = {}  # (sending stage, tag) -> index of its compute action
    for stage, row in enumerate(rows):
        for i, action in enumerate(row):
            out = produced(compute, action)
            if out is not None:
                producer[stage, out[1]] = i
    progress = True
    while progress:
        progress = False
        for stage in range(pp):
            # launches: a send once its producer finished, completing with the receive at the head of the peer's
            while lane[stage] < len(orders[stage]):
                message = orders[stage][lane[stage]]
                peer = message.peer
                if lane[peer] >= len(orders[peer]):
                    break
                other = orders[peer][lane[peer]]
                if other != Message(not message.send, stage, message.tag):
                    break
                sender = stage if message.send else peer
                if (sender, producer[sender, message.tag]) not in done_compute:
                    break
                lane[stage] += 1
                lane[peer] += 1
                arrived.add((peer if message.send else stage, message.tag))
                progress = True
            # compute: in order, each once the message it consumes arrived
            while pos[stage] < len(rows[stage]):
                action = rows[stage][pos[stage]]
                needed = consumed(compute, action)
                remote = needed is not None and compute.rank_of(needed[0]) != stage
                if remote and (stage, needed[1]) not in arrived:  # type: ignore[index]  # (remote: not None)
                    break
                done_compute.add((stage, pos[stage]))
                pos[stage] += 1
                progress = True
    stuck = [
        f"stage {s}: {orders[s][lane[s]] if lane[s] < len(orders[s]) else 'no launch left'}, at its compute "
        f"action {rows[s][pos[s]] if pos[s] < len(rows[s]) else '(done)'}"
        for s in range(pp)
        if lane[s] < len(orders[s]) or pos[s] < len(rows[s])
    ]
    if stuck:
        raise ScheduleError(
            f"plan {plan.name!r}: these stages wait for each other on a transport where a send waits for its "
            "receive and a stage's launches run in order (NCCL):\n  " + "\n  ".join(stuck)
        )
