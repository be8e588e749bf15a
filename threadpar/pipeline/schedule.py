"""Pipeline schedules as data (pure: no torch, no threads): actions, plans, their text form, generators.

An `Action` is one unit of work on one rank: the forward (F) or backward of one microbatch through one
chunk, where a backward is full (B) or split in two (Qi et al., "Zero Bubble Pipeline Parallelism", 2023):
I computes the gradient of the chunk's input only and sends it upstream at once; W computes the gradient
of the chunk's weights later, from what I kept, filling what would be a bubble. The kinds are
torch.distributed.pipelining's (F, B, I, W), so a plan's text reads the same on its own: "0B3" is always a
full backward, "0I3" and "0W3" the halves of a split one.
Chunks are numbered globally (virtual stages): chunk c runs on rank c % pp as local chunk c // pp (the
"loop" placement; ZB-V's "v" placement puts rank r's two chunks at r and 2 pp - 1 - r instead), so the
forward of chunk c feeds chunk c + 1, which runs on the next rank (wrapping from the last rank to rank 0
when a rank holds several chunks). Its short form is torch's too: "1F3" is chunk 1, forward, microbatch 3.

A schedule's plan holds compute actions only. `lowering.lower(plan)` adds what running it takes besides: the
messages (SEND_F, RECV_F, SEND_B, RECV_B, torch's names: "0SEND_F3", "1RECV_F3") and each
chunk's gradient synchronization ("0SYNC_GRAD"); the executor runs that lowered plan as written.

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


# What an action does. Compute: a forward, a full (fused) backward, the input-gradient half of a split
# backward, its weight-gradient half (torch.distributed.pipelining's F, B, I, W).
COMPUTE_KINDS = ("F", "B", "I", "W")
# Messages (lowering.py adds them): chunk c's output sent to chunk c + 1 (SEND_F) and posted to be received
# there as chunk c + 1's input (RECV_F); chunk c's input gradient sent back (SEND_B) and posted to be
# received as chunk c - 1's output gradient (RECV_B). torch's names; each is labelled by the chunk on the
# rank that runs it, as torch labels them.
MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# The gradient synchronization of a chunk (data parallel): "the next action of this chunk that accumulates
# weight gradients also reduces them" (a DDP chunk leaves no_sync() for it). One per chunk and step.
SYNC_GRAD = "SYNC_GRAD"
KINDS = (*COMPUTE_KINDS, *MESSAGE_KINDS, SYNC_GRAD)
NO_MICROBATCH = -1  # the microbatch of a SYNC_GRAD, which is per chunk


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work of `rank` on global chunk `chunk` for `microbatch`: a compute action (F, B, I, W), a
    message (SEND_F, RECV_F, SEND_B, RECV_B) or a chunk's gradient synchronization (SYNC_GRAD)."""

    rank: int
    chunk: int
    microbatch: int
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; use one of {', '.join(KINDS)}")

    @property
    def forward(self) -> bool:
        return self.kind == "F"

    @property
    def weight(self) -> bool:
        """The weight-gradient half of a split backward."""
        return self.kind == "W"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_backward(self) -> bool:
        """A backward that computes the chunk's input gradient: a full one (B) or its input half (I)."""
        return self.kind in ("B", "I")

    @property
    def accumulates(self) -> bool:
        """Whether it accumulates weight gradients: a full backward (B) or a weight half (W)."""
        return self.kind in ("B", "W")

    @property
    def key(self) -> tuple[int, int]:
        """(chunk, microbatch): what the actions of one microbatch through one chunk share."""
        return (self.chunk, self.microbatch)

    def __str__(self) -> str:
        if self.kind == SYNC_GRAD:
            return f"{self.chunk}{self.kind}"
        return f"{self.chunk}{self.kind}{self.microbatch}"

    def local_chunk(self, pp: int) -> int:
        """Index of the chunk among the rank's own chunks (the loop placement; the V's are 0 and 1 too)."""
        return self.chunk // pp

    @classmethod
    def parse(cls, text: str, rank: int) -> Action:
        """Inverse of str(): `Action.parse("1F3", rank=1)`, `Action.parse("0SEND_F2", rank=0)`."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None or (match.group(2).upper() == SYNC_GRAD) != (match.group(3) == ""):
            raise ScheduleError(
                f"cannot parse action {text!r}: write chunk, kind, microbatch, e.g. '0F1', '3B0', '3I0', '3W0', "
                "'0SEND_F1', '1RECV_F1', or chunk and SYNC_GRAD ('0SYNC_GRAD'); kinds: F forward, B full "
                "backward, I input-gradient half, W weight-gradient half"
            )
        chunk, kind, microbatch = match.groups()
        return cls(rank, int(chunk), int(microbatch) if microbatch else NO_MICROBATCH, kind.upper())


_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SYNC_GRAD|[FBIW])(\d*)", re.IGNORECASE)


@dataclass(frozen=True)
class Plan:
    """Every rank's ordered actions for `n` microbatches on `pp` ranks with `v` chunks each.

    A schedule's plan holds compute actions only; `lowering.lower(plan)` adds its messages and gradient
    synchronizations, and the executor runs that lowered plan as written."""

    name: str
    pp: int
    n: int
    v: int
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order
    placement: str = (
        "loop"  # "loop": chunk c on rank c % pp; "v" (v = 2): chunks r and 2 pp - 1 - r on rank r
    )
    forward_only: bool = field(init=False)
    # (chunk, microbatch) whose backward is split: an I computes the input gradient only, a W the rest
    split: frozenset[tuple[int, int]] = field(init=False)
    lowered: bool = field(init=False)  # holds messages and gradient synchronizations

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        actions = [a for row in self.actions for a in row if a.is_compute]
        object.__setattr__(self, "forward_only", bool(actions) and all(a.forward for a in actions))
        object.__setattr__(self, "split", frozenset(a.key for a in actions if a.kind == "I"))
        object.__setattr__(self, "lowered", any(not a.is_compute for row in self.actions for a in row))
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

    def compute_plan(self) -> Plan:
        """The compute actions alone (a lowered plan without its messages and synchronizations)."""
        if not self.lowered:
            return self
        rows = tuple(tuple(a for a in row if a.is_compute) for row in self.actions)
        return Plan(self.name, self.pp, self.n, self.v, rows, self.placement)

    def forward_plan(self) -> Plan:
        """The forwards alone, in the same order: what an evaluation step runs."""
        rows = tuple(tuple(a for a in row if a.forward) for row in self.compute_plan().actions)
        return Plan(f"{self.name} (forward only)", self.pp, self.n, self.v, rows, self.placement)


def _validate(plan: Plan) -> None:
    """Structural checks: every (chunk, microbatch) forward, and backward unless forward-only, exactly once
    on its rank, each backward after its forward; a backward is either full (B) or split into I and then
    W. A lowered plan's messages and synchronizations are checked too (`_validate_lowered`). Whether the
    plan deadlocks is the simulator's job."""
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
    seen: dict[tuple[int, int, str], tuple[int, int]] = {}  # (chunk, microbatch, kind) -> (rank, index)
    for rank, row in enumerate(plan.actions):
        for index, a in enumerate(row):
            where = f"plan {plan.name!r}, rank {rank}, action {index} ({a})"
            if a.rank != rank or plan.rank_of(a.chunk) != rank:
                raise ScheduleError(
                    f"{where}: chunk {a.chunk} runs on rank {plan.rank_of(a.chunk)}, not here"
                )
            mb_ok = a.microbatch == NO_MICROBATCH if a.kind == SYNC_GRAD else 0 <= a.microbatch < plan.n
            if not (0 <= a.chunk < plan.num_chunks and mb_ok):
                raise ScheduleError(
                    f"{where}: chunk must be in 0..{plan.num_chunks - 1}, microbatch in 0..{plan.n - 1}"
                )
            key = (a.chunk, a.microbatch, a.kind)
            if key in seen:
                raise ScheduleError(f"{where}: {a} appears twice")
            if a.is_compute:
                _check_compute_order(a, seen, where)
            seen[key] = (rank, index)
    kinds = ("F",) if plan.forward_only else ("F", "B")
    missing = [
        Action(plan.rank_of(c), c, m, k)
        for c in range(plan.num_chunks)
        for m in range(plan.n)
        for k in kinds
        if (c, m, k) not in seen and not (k == "B" and (c, m, "I") in seen)
    ] + [Action(plan.rank_of(c), c, m, "W") for c, m in sorted(plan.split) if (c, m, "W") not in seen]
    if missing:
        shown = ", ".join(f"r{a.rank}:{a}" for a in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ScheduleError(f"plan {plan.name!r} misses {len(missing)} actions: {shown}")
    if plan.lowered:
        _validate_lowered(plan, seen)


def _check_compute_order(a: Action, seen: dict, where: str) -> None:
    """A B or I after its forward, never both; a W after its I."""
    c, m = a.key
    if a.is_backward and (c, m, "F") not in seen:
        raise ScheduleError(f"{where}: the backward comes before its forward {c}F{m}")
    other = {"B": "I", "I": "B"}.get(a.kind)
    if other is not None and (c, m, other) in seen:
        raise ScheduleError(
            f"{where}: {c}{other}{m} is there already; a backward is either full (B) or split into its "
            "input half (I) and weight half (W)"
        )
    if a.kind == "W" and (c, m, "I") not in seen:
        what = "a W follows the I of a split backward, not a full B" if (c, m, "B") in seen else ""
        raise ScheduleError(f"{where}: the W comes before its I {c}I{m}" + (f" ({what})" if what else ""))


def _validate_lowered(plan: Plan, seen: dict[tuple[int, int, str], tuple[int, int]]) -> None:
    """A lowered plan: exactly the messages its compute actions need, each on the rank of its chunk, a
    receive before the action that consumes it and a send after the action that produces it; and one
    SYNC_GRAD per chunk (training plans), between the chunk's last two gradient-accumulating actions."""
    last = plan.num_chunks - 1

    def at(chunk: int, microbatch: int, kind: str) -> int:
        return seen[(chunk, microbatch, kind)][1]

    wanted: dict[tuple[int, int, str], tuple[str, bool]] = {}  # message -> (its compute kind, after it)
    for (c, m, kind), _ in seen.items():
        if kind == "F":
            if c > 0:
                wanted[(c, m, "RECV_F")] = ("F", False)
            if c < last:
                wanted[(c, m, "SEND_F")] = ("F", True)
        elif kind in ("B", "I"):
            if c < last:
                wanted[(c, m, "RECV_B")] = (kind, False)
            if c > 0:
                wanted[(c, m, "SEND_B")] = (kind, True)
    present = {k for k in seen if k[2] in MESSAGE_KINDS}
    for c, m, kind in sorted(present - wanted.keys()):
        raise ScheduleError(f"plan {plan.name!r}: {c}{kind}{m} carries no message the compute actions need")
    for (c, m, kind), (compute, after) in sorted(wanted.items()):
        message = f"{c}{kind}{m}"
        if (c, m, kind) not in seen:
            raise ScheduleError(
                f"plan {plan.name!r} (lowered) misses the message {message} of {c}{compute}{m}"
            )
        if (at(c, m, kind) > at(c, m, compute)) != after:
            where = "after" if after else "before"
            raise ScheduleError(
                f"plan {plan.name!r}: {message} must come {where} {c}{compute}{m} on rank {plan.rank_of(c)}"
            )
    syncs = {c for c, _, kind in seen if kind == SYNC_GRAD}
    if plan.forward_only:
        if syncs:
            raise ScheduleError(f"plan {plan.name!r} is forward only: it has no gradients to synchronize")
        return
    accumulating: dict[int, list[int]] = {}  # chunk -> indices of its B's and W's, in order
    for (c, _, kind), (_, i) in seen.items():
        if kind in ("B", "W"):
            accumulating.setdefault(c, []).append(i)
    for c in range(plan.num_chunks):
        if c not in syncs:
            raise ScheduleError(f"plan {plan.name!r} (lowered) misses {c}{SYNC_GRAD}")
        indices = sorted(accumulating[c])
        previous = indices[-2] if len(indices) > 1 else -1
        if not previous < at(c, NO_MICROBATCH, SYNC_GRAD) < indices[-1]:
            raise ScheduleError(
                f"plan {plan.name!r}: {c}{SYNC_GRAD} must come right before the last action of chunk {c} that "
                "accumulates weight gradients (its last B or W), after the one before it"
            )


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
            [Action(r, c, m, "F") for c, m in forwards] + [Action(r, c, m, "B") for c, m in backwards]
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
        row = [Action(r, r, m, "F") for m in range(warmup)]
        for i in range(n - warmup):
            row += [Action(r, r, warmup + i, "F"), Action(r, r, i, "B")]
        row += [Action(r, r, m, "B") for m in range(n - warmup, n)]
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
        return Action(r, local * pp + r, group * pp + within % pp, "F" if forward else "B")

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
    """The zero-bubble form of a 1F1B-ordered plan: every backward becomes an I (input gradient only, sent
    upstream at once), and rank r keeps its first r W's for later (the order of torch's
    ScheduleInterleavedZeroBubble): after each further I it runs the W of its oldest pending I, and the W's
    still pending run at the end, where 1F1B's ranks wait for the last gradients. Ranks nearer the end of
    the pipeline defer more W's, because their cool-down bubble is the longest."""
    rows = []
    for r, row in enumerate(base.actions):
        out: list[Action] = []
        pending: list[Action] = []
        backwards = 0
        for a in row:
            if a.forward:
                out.append(a)
                continue
            out.append(Action(r, a.chunk, a.microbatch, "I"))
            pending.append(a)
            if backwards >= r:
                w = pending.pop(0)
                out.append(Action(r, w.chunk, w.microbatch, "W"))
            backwards += 1
        out += [Action(r, w.chunk, w.microbatch, "W") for w in pending]
        rows.append(out)
    return Plan(name, base.pp, base.n, base.v, tuple(tuple(row) for row in rows))


def zbh1(pp: int, n: int, v: int = 1) -> Plan:
    """ZB-H1 (Qi et al. 2023): 1F1B's forwards and backwards, every backward split into I and W, the W's
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
    every backward split into I and W as in `zbh1` (torch's ScheduleInterleavedZeroBubble)."""
    _check_interleaved_sizes("zb_interleaved", "zbh1", pp, n, v)
    return _split_backwards(interleaved_1f1b(pp, n, v), "zb_interleaved")


def _zbv_row(pp: int, n: int, r: int) -> list[Action]:
    """Rank r's actions in ZB-V (the order of torch's ScheduleZBVZeroBubble)."""
    first, second = r, 2 * pp - 1 - r
    row: list[Action] = []
    count = {"F0": 0, "F1": 0, "I0": 0, "I1": 0, "W0": 0, "W1": 0}

    def add(kind: str, which: int) -> None:
        chunk = first if which == 0 else second
        m = count[f"{kind}{which}"]
        count[f"{kind}{which}"] += 1
        row.append(Action(r, chunk, m, kind))

    for _ in range(2 * (pp - r) - 1):  # warm-up: the first chunk fills the V's down stroke
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - r):  # the bottom of the V: the second chunk's F, I and W back to back
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while count["F1"] < count["F0"] or count["F0"] < n:  # steady state
        if count["F0"] < n:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(r):  # cool-down: I's first, W's where the other ranks still work
        add("I", 0)
        add("I", 1)
    for _ in range(pp - r):
        add("I", 0)
        add("W", 0)
    while count["W1"] < count["I1"]:
        add("W", 1)
    while count["W0"] < count["I0"]:
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
