"""Pipeline schedules as data (pure: no torch, no threads): actions, plans, their text form, generators.

An `Action` is one unit of work on one rank: the forward (F), backward (B) or weight-gradient (W) pass of one
microbatch through one chunk.
Chunks are numbered globally (virtual stages): chunk c runs on rank c % pp as local chunk c // pp (the
"loop" placement; ZB-V's "v" placement puts rank r's two chunks at r and 2 pp - 1 - r instead), so the
forward of chunk c feeds chunk c + 1, which runs on the next rank (wrapping from the last rank to rank 0
when a rank holds several chunks). Its short form is torch.distributed.pipelining's: "1F3" is chunk 1,
forward, microbatch 3.

Zero-bubble schedules split a backward in two (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): B
computes the gradient of the chunk's input only and sends it upstream at once; W computes the gradient of
the chunk's weights later, from what B kept, filling what would be a bubble. A plan says which backwards are
split by containing a W: "0B3" is the input-gradient half when the plan also holds "0W3", and the whole
(fused) backward when it does not. So every existing plan means what it meant.

A `Plan` is every rank's ordered action list. The generators build the classic schedules:

- afab / gpipe: all forwards, then all backwards (InfiniTrain's GPipe table, chunks in step order).
- 1f1b: pp - rank - 1 warm-up forwards, then one forward one backward, then the remaining backwards.
- interleaved: Megatron's interleaved 1F1B over v chunks per rank (needs n to be a multiple of pp).
- zbh1: ZB-H1, 1F1B's order with every backward split and the W's deferred to fill the bubbles.
- zb_interleaved: the same on interleaved 1F1B's order (torch's ScheduleInterleavedZeroBubble).
- zbv: ZB-V, two chunks per rank placed in a V (chunks r and 2 pp - 1 - r), every backward split.

`simulator.simulate` runs a plan to prove it cannot deadlock and to predict its timing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from threadpar.errors import ConfigError


class ScheduleError(ConfigError):
    """A plan that cannot run: a missing or misplaced action, a backward before its forward, a deadlock."""


@dataclass(frozen=True, slots=True)
class Action:
    """The forward, backward or (`weight`) weight-gradient pass of `microbatch` through global chunk `chunk`,
    on `rank`. A W has forward=False and weight=True."""

    rank: int
    chunk: int
    microbatch: int
    forward: bool
    weight: bool = False

    @property
    def kind(self) -> str:
        """ "F", "B" or "W"."""
        return "F" if self.forward else "W" if self.weight else "B"

    @property
    def key(self) -> tuple[int, int]:
        """(chunk, microbatch): what the F, B and W of one microbatch through one chunk share."""
        return (self.chunk, self.microbatch)

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.microbatch}"

    def local_chunk(self, pp: int) -> int:
        """Index of the chunk among the rank's own chunks."""
        return self.chunk // pp

    @classmethod
    def parse(cls, text: str, rank: int) -> Action:
        """Inverse of str(): `Action.parse("1F3", rank=1)`."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: write chunk, F, B or W, microbatch, e.g. '0F1', '3B0', '3W0'"
            )
        chunk, kind, microbatch = match.groups()
        kind = kind.upper()
        return cls(rank, int(chunk), int(microbatch), kind == "F", kind == "W")


_ACTION_RE = re.compile(r"(\d+)([FBWfbw])(\d+)")


@dataclass(frozen=True)
class Plan:
    """Every rank's ordered actions for `n` microbatches on `pp` ranks with `v` chunks each."""

    name: str
    pp: int
    n: int
    v: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order
    placement: str = (
        "loop"  # "loop": chunk c on rank c % pp; "v" (v = 2): chunks r and 2 pp - 1 - r on rank r
    )
    forward_only: bool = field(init=False)
    # (chunk, microbatch) whose backward is split: its B computes the input gradient only, its W the rest
    split: frozenset[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        actions = [a for row in self.actions for a in row]
        object.__setattr__(self, "forward_only", bool(actions) and all(a.forward for a in actions))
        object.__setattr__(self, "split", frozenset(a.key for a in actions if a.weight))
        _validate(self)

    @property
    def num_chunks(self) -> int:
        return self.pp * self.v

    def rank_of(self, chunk: int) -> int:
        """The rank that runs global chunk `chunk`."""
        return chunk_rank(chunk, self.pp, self.placement)

    def __str__(self) -> str:
        return "\n".join(f"r{r}: {' '.join(str(a) for a in row)}" for r, row in enumerate(self.actions))

    @classmethod
    def parse(cls, text: str, name: str = "custom") -> Plan:
        """Inverse of str(): one line per rank, "r0: 0F0 0F1 0B0 0B1"; pp, n and v follow from the actions."""
        rows: list[list[Action]] = []
        for line in (ln.strip() for ln in text.strip().splitlines()):
            if not line:
                continue
            label, sep, body = line.partition(":")
            if not sep or label.strip() != f"r{len(rows)}":
                raise ScheduleError(
                    f"plan line {line!r} must start with 'r{len(rows)}:' (one line per rank, in rank order)"
                )
            rows.append([Action.parse(tok, len(rows)) for tok in body.split()])
        actions = [a for row in rows for a in row]
        if not actions:
            raise ScheduleError("cannot parse an empty plan: give one line of actions per rank")
        pp = len(rows)
        v = max(a.chunk for a in actions) // pp + 1
        n = max(a.microbatch for a in actions) + 1
        # A chunk that is not on rank chunk % pp can only mean the V placement (validation checks the rest).
        placement = "v" if v == 2 and any(a.chunk % pp != a.rank for a in actions) else "loop"
        return cls(name, pp, n, v, tuple(tuple(r) for r in rows), placement)

    def forward_plan(self) -> Plan:
        """The forwards alone, in the same order: what an evaluation step runs."""
        rows = tuple(tuple(a for a in row if a.forward) for row in self.actions)
        return Plan(f"{self.name} (forward only)", self.pp, self.n, self.v, rows, self.placement)


def _validate(plan: Plan) -> None:
    """Structural checks: every (chunk, microbatch) forward, and backward unless forward-only, exactly
    once on its rank, each backward after its forward, each W (optional) after its B. Whether the plan
    deadlocks is the simulator's job."""
    for name in ("pp", "n", "v"):
        value = getattr(plan, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"plan {plan.name!r}: {name} must be a positive int, got {value!r}")
    if plan.placement not in ("loop", "v") or (plan.placement == "v" and plan.v != 2):
        raise ScheduleError(
            f"plan {plan.name!r}: placement must be 'loop' or 'v' (with v=2), got {plan.placement!r} with v={plan.v}"
        )
    if len(plan.actions) != plan.pp:
        raise ScheduleError(f"plan {plan.name!r} has {len(plan.actions)} rank rows for pp={plan.pp}")
    seen: dict[tuple[int, int, str], int] = {}
    for rank, row in enumerate(plan.actions):
        for index, a in enumerate(row):
            where = f"plan {plan.name!r}, rank {rank}, action {index} ({a})"
            if a.rank != rank or plan.rank_of(a.chunk) != rank:
                raise ScheduleError(
                    f"{where}: chunk {a.chunk} runs on rank {plan.rank_of(a.chunk)}, not here"
                )
            if not (0 <= a.chunk < plan.num_chunks and 0 <= a.microbatch < plan.n):
                raise ScheduleError(
                    f"{where}: chunk must be in 0..{plan.num_chunks - 1}, microbatch in 0..{plan.n - 1}"
                )
            key = (a.chunk, a.microbatch, a.kind)
            if key in seen:
                raise ScheduleError(f"{where}: {a} appears twice")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before is not None and (a.chunk, a.microbatch, before) not in seen:
                what = (
                    "the backward comes before its forward" if before == "F" else "the W comes before its B"
                )
                raise ScheduleError(f"{where}: {what} {a.chunk}{before}{a.microbatch}")
            seen[key] = index
    kinds = ("F",) if plan.forward_only else ("F", "B")
    missing = [
        Action(plan.rank_of(c), c, m, k == "F")
        for c in range(plan.num_chunks)
        for m in range(plan.n)
        for k in kinds
        if (c, m, k) not in seen
    ]
    if missing:
        shown = ", ".join(f"r{a.rank}:{a}" for a in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(f"plan {plan.name!r} misses {len(missing)} actions: {shown}")


def chunk_rank(chunk: int, pp: int, placement: str = "loop") -> int:
    """The rank of global chunk `chunk`: chunk % pp ("loop"), or a V over two chunks per rank ("v")."""
    if placement == "v" and chunk >= pp:
        return 2 * pp - 1 - chunk
    return chunk % pp


# generators -------------------------------------------------------------------------------------------------
def _check_sizes(schedule: str, pp: object, n: object, v: object) -> None:
    for name, value in (("pp", pp), ("num_microbatches", n), ("chunks per rank", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"schedule {schedule!r}: {name} must be a positive int, got {value!r}")


def afab(pp: int, n: int, v: int = 1) -> Plan:
    """All forwards, then all backwards (GPipe). With v > 1 each rank runs its chunks in the order of
    InfiniTrain's table: forward of (c, m) at step m + c, backward at step m + (pp*v - 1 - c)."""
    _check_sizes("afab", pp, n, v)
    last = pp * v - 1
    rows = []
    for r in range(pp):
        cells = [(c, m) for c in range(r, pp * v, pp) for m in range(n)]
        forwards = sorted(cells, key=lambda cm: (cm[1] + cm[0], cm[0]))
        backwards = sorted(cells, key=lambda cm: (cm[1] + last - cm[0], -cm[0]))
        rows.append(
            [Action(r, c, m, True) for c, m in forwards] + [Action(r, c, m, False) for c, m in backwards]
        )
    return Plan("afab", pp, n, v, tuple(tuple(row) for row in rows))


def one_f_one_b(pp: int, n: int, v: int = 1) -> Plan:
    """1F1B: rank r runs min(pp - r - 1, n) warm-up forwards, then alternates forward and backward, then
    drains the backwards. At most pp - r microbatches are in flight on rank r."""
    _check_sizes("1f1b", pp, n, v)
    if v != 1:
        raise ConfigError(
            f"schedule '1f1b' runs one chunk per rank, but this rank has {v}; "
            "use schedule='interleaved' for several chunks per rank, or 'afab'"
        )
    rows = []
    for r in range(pp):
        warmup = min(pp - r - 1, n)
        row = [Action(r, r, m, True) for m in range(warmup)]
        for i in range(n - warmup):
            row += [Action(r, r, warmup + i, True), Action(r, r, i, False)]
        row += [Action(r, r, m, False) for m in range(n - warmup, n)]
        rows.append(row)
    return Plan("1f1b", pp, n, 1, tuple(tuple(row) for row in rows))


def _check_interleaved_sizes(schedule: str, one_chunk: str, pp: int, n: int, v: int) -> None:
    """What an interleaved order needs: v >= 2 chunks per rank and n a multiple of pp."""
    _check_sizes(schedule, pp, n, v)
    if v < 2:
        raise ConfigError(
            f"schedule {schedule!r} needs at least 2 chunks per rank (one module per chunk); "
            f"with one chunk per rank use schedule={one_chunk!r}"
        )
    if n % pp:
        raise ConfigError(
            f"schedule {schedule!r} sends microbatches through the chunks in groups of pp={pp}, so "
            f"num_microbatches must be a multiple of {pp}; got {n}: use {max(pp, n - n % pp)} or "
            f"{n - n % pp + pp}, or schedule={one_chunk!r}" + ("/'afab'" if one_chunk == "1f1b" else "")
        )


def interleaved_1f1b(pp: int, n: int, v: int = 2) -> Plan:
    """Megatron's interleaved 1F1B. Microbatches go through the chunks in groups of pp: the k-th forward of
    a rank is microbatch (k // (pp*v)) * pp + k % pp on its local chunk (k // pp) % v; backwards visit the
    local chunks in reverse. Warm-up: 2 (pp - r - 1) + (v - 1) pp forwards."""
    _check_interleaved_sizes("interleaved", "1f1b", pp, n, v)
    total = n * v

    def action(r: int, k: int, forward: bool) -> Action:
        group, within = divmod(k, pp * v)
        local = within // pp if forward else v - 1 - within // pp
        return Action(r, local * pp + r, group * pp + within % pp, forward)

    rows = []
    for r in range(pp):
        warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        row = [action(r, k, True) for k in range(warmup)]
        for i in range(total - warmup):
            row += [action(r, warmup + i, True), action(r, i, False)]
        row += [action(r, k, False) for k in range(total - warmup, total)]
        rows.append(row)
    return Plan("interleaved", pp, n, v, tuple(tuple(row) for row in rows))


def _split_backwards(base: Plan, name: str) -> Plan:
    """The zero-bubble form of a 1F1B-ordered plan: every backward becomes a B (input gradient only, sent
    upstream at once), and rank r keeps its first r W's for later (the order of torch's
    ScheduleInterleavedZeroBubble): after each further B it runs the W of its oldest pending B, and the W's
    still pending run at the end, where 1F1B's ranks wait for the last gradients. Ranks nearer the end of
    the pipeline defer more W's, because their cool-down bubble is the longest."""
    rows = []
    for r, row in enumerate(base.actions):
        out: list[Action] = []
        pending: list[Action] = []
        backwards = 0
        for a in row:
            out.append(a)
            if a.forward:
                continue
            pending.append(a)
            if backwards >= r:
                w = pending.pop(0)
                out.append(Action(r, w.chunk, w.microbatch, False, True))
            backwards += 1
        out += [Action(r, w.chunk, w.microbatch, False, True) for w in pending]
        rows.append(out)
    return Plan(name, base.pp, base.n, base.v, tuple(tuple(row) for row in rows))


def zbh1(pp: int, n: int, v: int = 1) -> Plan:
    """ZB-H1 (Qi et al. 2023): 1F1B's forwards and backwards, every backward split into B and W, the W's
    deferred into what 1F1B leaves idle. With F = B = W its idle time is about a third of 1F1B's, and at most
    pp microbatches are in flight on any rank (1F1B's peak, on its first rank)."""
    _check_sizes("zbh1", pp, n, v)
    if v != 1:
        raise ConfigError(
            f"schedule 'zbh1' runs one chunk per rank, but this rank has {v}; use "
            "schedule='zb_interleaved' for several chunks per rank"
        )
    return _split_backwards(one_f_one_b(pp, n), "zbh1")


def zb_interleaved(pp: int, n: int, v: int = 2) -> Plan:
    """Interleaved zero bubble: interleaved 1F1B's order (v >= 2 chunks per rank, n a multiple of pp) with
    every backward split into B and W as in `zbh1` (torch's ScheduleInterleavedZeroBubble)."""
    _check_interleaved_sizes("zb_interleaved", "zbh1", pp, n, v)
    return _split_backwards(interleaved_1f1b(pp, n, v), "zb_interleaved")


def _zbv_row(pp: int, n: int, r: int) -> list[Action]:
    """Rank r's actions in ZB-V (the order of torch's ScheduleZBVZeroBubble)."""
    first, second = r, 2 * pp - 1 - r
    row: list[Action] = []
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0, "W0": 0, "W1": 0}

    def add(kind: str, which: int) -> None:
        chunk = first if which == 0 else second
        m = count[f"{kind}{which}"]
        count[f"{kind}{which}"] += 1
        row.append(Action(r, chunk, m, kind == "F", kind == "W"))

    for _ in range(2 * (pp - r) - 1):  # warm-up: the first chunk fills the V's down stroke
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):  # the bottom of the V: the second chunk's F, B and W back to back
        add("F", 1)
        add("B", 1)
        add("W", 1)
    while count["F1"] < count["F0"] or count["F0"] < n:  # steady state
        if count["F0"] < n:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        add("F", 1)
        add("B", 1)
        add("W", 1)
    for _ in range(r):  # cool-down: B's first, W's where the other ranks still work
        add("B", 0)
        add("B", 1)
    for _ in range(pp - r):
        add("B", 0)
        add("W", 0)
    while count["W1"] < count["B1"]:
        add("W", 1)
    while count["W0"] < count["B0"]:
        add("W", 0)
    return row


def zbv(pp: int, n: int, v: int = 2) -> Plan:
    """ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble): two chunks per rank in a V, rank r
    holding chunks r and 2 pp - 1 - r, so the last rank passes its first chunk's output to its second
    chunk without a message; every backward split, W's filling the bubbles. Needs n >= 2 pp - 1 (rank 0's
    warm-up runs that many forwards of its first chunk)."""
    _check_sizes("zbv", pp, n, v)
    if v != 2:
        raise ConfigError(
            f"schedule 'zbv' runs exactly 2 chunks per rank (a V), but this rank has {v}; pass 2 chunks, or "
            "use 'zbh1' (1 chunk) or 'zb_interleaved' (any number)"
        )
    if n < 2 * pp - 1:
        raise ConfigError(
            f"schedule 'zbv' needs num_microbatches >= 2 * pp - 1 = {2 * pp - 1} (its warm-up), got {n}; use "
            f"more microbatches, or schedule='zbh1'"
        )
    rows = [_zbv_row(pp, n, r) for r in range(pp)]
    return Plan("zbv", pp, n, 2, tuple(tuple(row) for row in rows), "v")


SCHEDULES: dict[str, Callable[[int, int, int], Plan]] = {
    "afab": afab,
    "gpipe": afab,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "interleaved_1f1b": interleaved_1f1b,
    "interleaved1f1b": interleaved_1f1b,
    "zbh1": zbh1,
    "zb_h1": zbh1,
    "zb_interleaved": zb_interleaved,
    "interleaved_zb": zb_interleaved,
    "zbv": zbv,
    "zb_v": zbv,
}


def default_chunks_per_rank(schedule: str) -> int:
    """How many chunks per rank a named schedule runs by default: 2 for the interleaved ones, else 1."""
    key = schedule.lower().replace("-", "_")
    return 2 if SCHEDULES.get(key) in (interleaved_1f1b, zb_interleaved, zbv) else 1


def schedule_placement(schedule: str) -> str:
    """Where a named schedule puts the chunks: "v" for ZB-V, else "loop" (for get_stage_info/build_chunks)."""
    return "v" if SCHEDULES.get(schedule.lower().replace("-", "_")) is zbv else "loop"


def build_plan(schedule: str, pp: int, n: int, v: int = 1) -> Plan:
    """The plan of a named schedule ("afab"/"gpipe", "1f1b", "interleaved", "zbh1", "zb_interleaved") for pp ranks, n microbatches
    and v chunks per rank; raises ConfigError at once for sizes the schedule cannot run."""
    key = schedule.lower().replace("-", "_") if isinstance(schedule, str) else None
    if key not in SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {schedule!r}; use one of 'afab' (alias 'gpipe'), '1f1b', "
            "'interleaved', 'zbh1', 'zb_interleaved', 'zbv', or pass a Plan"
        )
    return SCHEDULES[key](pp, n, v)
