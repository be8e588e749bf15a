"""Lowering (pure): a plan of compute actions -> the plan the executor runs, with its messages and
gradient synchronizations as actions (torch.distributed.pipelining's `_add_send_recv` step, for this
executor's transport).

For each rank, in the plan's order, every compute action gets:
  - before it, the receive it consumes: RECV_F (the input of chunk c > 0) before an F, RECV_B (the gradient
    of chunk c's output, c below the last chunk) before a B or I. A receive is *posted* there, and the
    compute action waits for it. With `prefetch` the receive of each action is posted one compute action
    earlier, so its transfer overlaps that action (on a transport where data moves only once the receive
    is posted; threadpar's own backends buffer every send, so posting changes nothing there) -- but never
    before the forward whose output it is the gradient of (whether a gradient comes back is known only then);
  - after it, the message it produces: SEND_F after an F (chunk c below the last), SEND_B after a B or I
    (chunk c > 0: dL/d(input) goes back to chunk c - 1's rank);
  - before the chunk's last gradient-accumulating action (its last B or W), one SYNC_GRAD: that action
    also synchronizes the chunk's gradients, as DDP's reducer does while a backward runs, so the all-reduce
    overlaps it; every earlier one only accumulates (DDP's no_sync()).

Messages between two chunks on one rank (pp = 1, the bottom of ZB-V's V) are lowered the same way and
travel through the rank's local channel: one rule for every boundary. (torch passes those locally without
a message; and its REDUCE_GRAD comes after a stage's last backward, for FSDP's post-backward, while its
runtime finds DDP's last backward by counting: here the lowered plan says it.)

Sends never block (threadpar's transports buffer them) and a compute action waits only for the receive it
consumes, so the lowered plan runs exactly when its compute plan does: `simulate(lower(plan))` gives every
compute action the times `simulate(plan)` gives it (tests/test_pipeline_lowering.py checks the grid).
"""

from __future__ import annotations

from threadpar.pipeline.schedule import NO_MICROBATCH, SYNC_GRAD, Action, Plan, ScheduleError


def receive_of(action: Action, last_chunk: int) -> Action | None:
    """The receive a compute action consumes, or None (the first chunk's F, the last chunk's backward, W)."""
    if action.forward and action.chunk > 0:
        return Action(action.rank, action.chunk, action.microbatch, "RECV_F")
    if action.is_backward and action.chunk < last_chunk:
        return Action(action.rank, action.chunk, action.microbatch, "RECV_B")
    return None


def send_of(action: Action, last_chunk: int) -> Action | None:
    """The message a compute action produces, or None (the last chunk's F, the first chunk's backward, W)."""
    if action.forward and action.chunk < last_chunk:
        return Action(action.rank, action.chunk, action.microbatch, "SEND_F")
    if action.is_backward and action.chunk > 0:
        return Action(action.rank, action.chunk, action.microbatch, "SEND_B")
    return None


def lower(plan: Plan, *, prefetch: bool = True) -> Plan:
    """The plan with its messages and gradient synchronizations (see the module docstring); a plan that is
    lowered already is returned as it is."""
    if plan.lowered:
        return plan
    last = plan.num_chunks - 1
    rows = []
    for row in plan.actions:
        receives = [receive_of(a, last) for a in row]
        # The receive of action i is posted before action `posted_at[i]`: itself, or with prefetch the one
        # before, unless that is the forward of the same (chunk, microbatch).
        posted_at = list(range(len(row)))
        if prefetch:
            posted_at = [
                i - 1 if i > 0 and not (row[i - 1].forward and row[i - 1].key == row[i].key) else i
                for i in range(len(row))
            ]
        before: list[list[Action]] = [[] for _ in row]
        for i, receive in enumerate(receives):
            if receive is not None:
                before[posted_at[i]].append(receive)
        if not plan.forward_only:
            last_accumulating = {a.chunk: i for i, a in enumerate(row) if a.accumulates}
            for chunk, i in sorted(last_accumulating.items()):
                before[i].append(Action(row[i].rank, chunk, NO_MICROBATCH, SYNC_GRAD))
        out: list[Action] = []
        for i, action in enumerate(row):
            out += before[i]
            out.append(action)
            send = send_of(action, last)
            if send is not None:
                out.append(send)
        rows.append(tuple(out))
    lowered = Plan(plan.name, plan.pp, plan.n, plan.v, tuple(rows), plan.placement)
    if lowered.compute_plan().actions != plan.actions:  # a broken pass, not a user error
        raise ScheduleError(f"lowering plan {plan.name!r} changed its compute actions")
    return lowered
