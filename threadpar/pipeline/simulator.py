"""Dry-run a plan (pure): blocking receives, buffered sends, unit or given costs; and the grid printer.

Each rank runs its actions in order. An action starts when its rank is free and its inputs have arrived:
the forward of chunk c needs the forward of chunk c - 1 (same microbatch), the backward (B or I) of chunk c
needs its own forward and the backward of chunk c + 1, and a W needs its own I. In a lowered plan the
messages carry these: a forward waits for the SEND_F of chunk c - 1, a backward for the SEND_B of chunk
c + 1; messages and SYNC_GRAD cost nothing and wait for nothing (sends never block: threadpar's mailboxes
buffer them; a receive is posted, and the compute action that consumes it waits). Costs: F `forward`,
I `backward`, W `weight`; a full backward (B) does both halves, so it costs `backward + weight`.
If no rank can move while some still have work, the plan deadlocks: `simulate` raises a ScheduleError
with the grid of what ran and the blocked actions marked. Otherwise it reports every action's start and
finish, each rank's peak number of saved activations (forwards whose backward, or W when split, has not
run: an I keeps the graph alive for its W), the peak number of I's waiting for their W, and the bubble.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from threadpar.errors import ConfigError
from threadpar.pipeline.schedule import Action, Plan, ScheduleError

Key = tuple[int, int, str]  # (chunk, microbatch, kind: "F", "B", "I", "W", "SEND_F", ...)
# An error grid wider than this many time steps shows only the steps around the marked actions.
GRID_MAX_STEPS = 24


@dataclass(frozen=True)
class Simulation:
    plan: Plan
    start: tuple[tuple[float, ...], ...]  # start[rank][i]: start time of the rank's i-th action
    finish: tuple[tuple[float, ...], ...]
    busy: tuple[float, ...]  # per rank: total cost of its actions
    peak_in_flight: tuple[int, ...]  # per rank: most (chunk, microbatch) activations saved at once
    peak_awaiting_weight: tuple[int, ...]  # per rank: most I's whose W has not run yet

    @property
    def makespan(self) -> float:
        return max((row[-1] for row in self.finish if row), default=0.0)

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks over the step: 1 - total busy time / (pp * makespan)."""
        span = self.makespan
        return 1.0 - sum(self.busy) / (self.plan.pp * span) if span > 0 else 0.0

    def grid(self, mark: Iterable[tuple[int, int]] = (), legend: str = "") -> str:
        """Ranks x start times; `mark` holds (rank, action index) pairs to show in brackets."""
        return render_grid(self.plan, self.start, set(mark), legend)


def in_flight_peaks(plan: Plan) -> tuple[int, ...]:
    """Per rank, the most forwards done whose backward has not fully run (a split one: its W), i.e. what
    its executor must keep saved."""
    return _peaks(plan, lambda a: 1 if a.forward else -1 if a.accumulates else 0)


def awaiting_weight_peaks(plan: Plan) -> tuple[int, ...]:
    """Per rank, the most I's done whose W has not run (their graphs wait for the W)."""
    return _peaks(plan, lambda a: 1 if a.kind == "I" else -1 if a.weight else 0)


def _peaks(plan: Plan, change: Callable[[Action], int]) -> tuple[int, ...]:
    peaks = []
    for row in plan.actions:
        live = peak = 0
        for a in row:
            live += change(a)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def _inputs(plan: Plan, a: Action) -> list[Key]:
    """The actions whose results `a` waits for."""
    last_chunk = plan.num_chunks - 1
    if a.forward:
        if a.chunk == 0:
            return []
        return [(a.chunk - 1, a.microbatch, "SEND_F" if plan.lowered else "F")]
    if a.weight:
        return [(a.chunk, a.microbatch, "I")]
    if not a.is_backward:
        return []  # messages and SYNC_GRAD follow their rank's order only
    deps = [(a.chunk, a.microbatch, "F")]
    if a.chunk < last_chunk:
        upstream = "SEND_B" if plan.lowered else "I" if (a.chunk + 1, a.microbatch) in plan.split else "B"
        deps.append((a.chunk + 1, a.microbatch, upstream))
    return deps


def _cost_function(
    plan: Plan,
    forward: float,
    backward: float,
    weight: float | None,
    cost: Callable[[Action], float] | None,
) -> Callable[[Action], float]:
    if cost is not None:
        if not callable(cost):
            raise ConfigError(f"cost must be a function of an Action, got {type(cost).__name__}")
        return cost
    if weight is None:  # unit costs: a W is a step of its own; without W's, a backward is one step
        weight = 1.0 if plan.split else 0.0
    for name, value in (("forward", forward), ("backward", backward), ("weight", weight)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{name} cost must be a non-negative number, got {value!r}")
    costs = {"F": forward, "I": backward, "W": weight, "B": backward + weight}
    return lambda a: costs[a.kind]


def simulate(
    plan: Plan,
    *,
    forward: float = 1.0,
    backward: float = 1.0,
    weight: float | None = None,
    cost: Callable[[Action], float] | None = None,
    latency: float = 0.0,
) -> Simulation:
    """Run `plan` with the given cost per forward (F), input gradient (I) and weight gradient (W), or
    `cost(action)` for compute actions, and `latency` from a send on one rank to its receive on another. A
    full backward (B) costs backward + weight; a lowered plan's messages and SYNC_GRAD cost nothing. weight=None: 1 for a plan with W actions (each its own unit step), else 0 (so that
    `backward` is the whole backward, as before). Raises ScheduleError if the plan deadlocks."""
    compute_cost = _cost_function(plan, forward, backward, weight, cost)

    def cost_of(a: Action) -> float:
        return float(compute_cost(a)) if a.is_compute else 0.0

    pp = plan.pp
    rows = plan.actions
    start = [[0.0] * len(row) for row in rows]
    finish = [[0.0] * len(row) for row in rows]
    done: dict[Key, float] = {}
    pos, free = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        # Start times depend only on the rank's previous action and the inputs' finish times, so the order
        # in which ranks are advanced here does not change the result.
        progress = False
        for r in range(pp):
            row = rows[r]
            while pos[r] < len(row):
                a = row[pos[r]]
                deps = _inputs(plan, a)
                if any(d not in done for d in deps):
                    break
                ready = max(
                    (done[d] + (latency if plan.rank_of(d[0]) != r else 0.0) for d in deps), default=0.0
                )
                t0 = max(free[r], ready)
                t1 = t0 + cost_of(a)
                start[r][pos[r]], finish[r][pos[r]] = t0, t1
                done[(a.chunk, a.microbatch, a.kind)] = free[r] = t1
                pos[r] += 1
                progress = True
    if any(pos[r] < len(rows[r]) for r in range(pp)):
        _raise_deadlock(plan, start, pos, free, done)
    busy = tuple(sum(f - s for s, f in zip(start[r], finish[r])) for r in range(pp))
    return Simulation(
        plan=plan,
        start=tuple(tuple(row) for row in start),
        finish=tuple(tuple(row) for row in finish),
        busy=busy,
        peak_in_flight=in_flight_peaks(plan),
        peak_awaiting_weight=awaiting_weight_peaks(plan),
    )


def _raise_deadlock(plan: Plan, start: list, pos: list[int], free: list[float], done: dict) -> None:
    pp = plan.pp
    lines, marks, shown = [], set(), []
    for r in range(pp):
        row = plan.actions[r]
        if pos[r] >= len(row):
            shown.append(list(start[r]))
            continue
        a = row[pos[r]]
        waits = [
            f"{c}{k}{m} on rank {plan.rank_of(c)}" for c, m, k in _inputs(plan, a) if (c, m, k) not in done
        ]
        lines.append(f"  rank {r}: {a} waits for {', '.join(waits)}")
        marks.add((r, pos[r]))
        # What ran, then the blocked action at the time the rank started waiting.
        shown.append([*start[r][: pos[r]], free[r]])
    grid = render_grid(plan, shown, marks, "[x] = blocked forever")
    cycle = _wait_cycle(plan, pos, done)
    raise ScheduleError(
        f"plan {plan.name!r} (pp={plan.pp}, n={plan.n}, v={plan.v}) deadlocks: no rank can make progress\n"
        + "\n".join(lines)
        + ("\n  they wait for each other: " + cycle if cycle else "")
        + "\n"
        + grid
    )


def _wait_cycle(plan: Plan, pos: list[int], done: dict) -> str:
    """The blocked actions that wait for each other, as a cycle: "0B0 waits for 1B0, which rank 1 runs after
    its blocked 1F1; 1F1 waits for 0F1, which rank 0 runs after its blocked 0B0"."""
    pp = plan.pp
    order: list[int] = []  # ranks along the chain of waits
    steps: list[str] = []
    r = next(r for r in range(pp) if pos[r] < len(plan.actions[r]))
    while r not in order:
        order.append(r)
        a = plan.actions[r][pos[r]]
        c, m, k = next(d for d in _inputs(plan, a) if d not in done)
        q = plan.rank_of(c)  # the rank that would produce it is blocked itself (or it could run)
        blocker = plan.actions[q][pos[q]]
        if (blocker.chunk, blocker.microbatch, blocker.kind) == (c, m, k):
            steps.append(f"{a} waits for {c}{k}{m} on rank {q}, blocked itself")
        else:
            steps.append(f"{a} waits for {c}{k}{m}, which rank {q} runs after its blocked {blocker}")
        r = q
    return "; ".join(steps[order.index(r) :])


def render_grid(
    plan: Plan, starts: Sequence[Sequence[float]], mark: set[tuple[int, int]], legend: str
) -> str:
    """One row per rank, one column per distinct start time; "." where no action starts, actions that start
    together (a lowered plan's messages at no cost) joined by "+"."""
    rows = [list(row) for row in starts]
    times = sorted({round(t, 9) for row in rows for t in row})
    column = {t: i for i, t in enumerate(times)}
    parts: list[list[list[Action]]] = [[[] for _ in times] for _ in range(plan.pp)]
    for r, row in enumerate(rows):
        for i, t in enumerate(row):
            parts[r][column[round(t, 9)]].append(plan.actions[r][i])
    marked = {plan.actions[r][i] for r, i in mark}
    cells = [["+".join(f"[{a}]" if a in marked else str(a) for a in p) or "." for p in row] for row in parts]
    # Room for the longest cell and its brackets, so that columns stay apart.
    width = max((len("+".join(map(str, p))) for row in parts for p in row), default=3) + 2
    keep = _visible_columns(len(times), {column[round(rows[r][i], 9)] for r, i in mark})
    unit = all(float(t).is_integer() for t in times)
    header = f"{plan.name}: pp={plan.pp} n={plan.n} v={plan.v}" + (
        "" if unit else " (columns: distinct start times)"
    )
    label = "step" if unit else "#"
    out = [header, _line(label, [str(times[c] if unit else c).removesuffix(".0") for c in keep], width)]
    for r in range(plan.pp):
        out.append(_line(f"r{r}", [cells[r][c] for c in keep], width))
    if len(keep) < len(times):
        out.append(f"(showing {len(keep)} of {len(times)} steps, around the marked actions)")
    if legend and mark:
        out.append(legend)
    return "\n".join(out)


def _visible_columns(total: int, marked: set[int]) -> list[int]:
    if total <= GRID_MAX_STEPS or not marked:
        return list(range(total))
    half = GRID_MAX_STEPS // (2 * len(marked)) or 1
    keep = {c for m in marked for c in range(m - half, m + half + 1) if 0 <= c < total}
    return sorted(keep)


def _line(label: str, cells: list[str], width: int) -> str:
    return (label.ljust(5) + "".join(c.center(width) for c in cells)).rstrip()
