"""What a pipeline step did, when: per-rank events, a Chrome trace (opens in Perfetto), the measured bubble.

Each rank's executor records every compute action (forward/backward of one chunk and microbatch) and
every send and receive (inside an action, or between two: a lowered plan's SEND_F follows its F), with host `time.perf_counter()` start and end times; all rank threads share
that clock. Compute time is an action's time minus the sends and receives inside it (a receive is mostly
waiting for the peer). On CUDA these are host times: a kernel may still run after its action ends.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from threadpar.errors import ConfigError

ACTION_CATEGORIES = ("forward", "backward", "weight")
COMM_CATEGORIES = ("send", "recv")


@dataclass(frozen=True, slots=True)
class Event:
    name: str  # "1F3" for an action; "recv 0F3" for the message that action waits for
    category: str  # forward, backward, send or recv
    start: float  # seconds, time.perf_counter()
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """One rank's events of one step (the executor clears it when a step begins)."""

    def __init__(self, rank: int, stage: int) -> None:
        self.rank = rank  # global rank
        self.stage = stage  # index in the pipeline group
        self.events: list[Event] = []  # read directly only once the launch has ended (ordered by its join)
        # record() runs on the rank thread and on its backward's autograd engine thread (CUDA): every change
        # holds the lock (DESIGN.md rule 10: nothing relies on the GIL to make list.append atomic).
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # timelines travel between processes (the demo gathers them): no lock
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def record(self, name: str, category: str, start: float, end: float) -> None:
        event = Event(name, category, start, end)
        with self._lock:
            self.events.append(event)

    def clear(self) -> None:
        with self._lock:
            self.events = []  # a new list: snapshots taken before keep their events

    def snapshot(self) -> Timeline:
        """A copy that the next step does not clear."""
        copy = Timeline(self.rank, self.stage)
        with self._lock:
            copy.events = list(self.events)
        return copy

    def action_costs(self) -> dict[str, float]:
        """Compute seconds of each action ("1F3": ...): its duration minus the messages inside it."""
        comm = [e for e in self.events if e.category in COMM_CATEGORIES]
        return {
            a.name: a.duration - sum(c.duration for c in comm if a.start <= c.start and c.end <= a.end)
            for a in self.events
            if a.category in ACTION_CATEGORIES
        }

    def compute_time(self) -> float:
        """Seconds spent in actions, minus the sends and receives inside them (a send between two actions,
        a lowered plan's SEND_F, is not compute)."""
        return sum(self.action_costs().values())

    def waiting_time(self) -> float:
        """Seconds spent in receives: mostly waiting for the peer's message to arrive."""
        return sum(e.duration for e in self.events if e.category == "recv")

    def __repr__(self) -> str:
        return f"Timeline(rank={self.rank}, stage={self.stage}, {len(self.events)} events)"


def _window(timelines: Sequence[Timeline]) -> tuple[float, float]:
    events = [e for t in timelines for e in t.events]
    if not events:
        raise ConfigError("the timelines hold no events: run a pipeline step first")
    return min(e.start for e in events), max(e.end for e in events)


def measured_bubble(timelines: Sequence[Timeline]) -> float:
    """Idle fraction of one pipeline's ranks over the step: 1 - total compute / (ranks * step time)."""
    timelines = list(timelines)
    t0, t1 = _window(timelines)
    return 1.0 - sum(t.compute_time() for t in timelines) / (len(timelines) * (t1 - t0))


def step_time(timelines: Sequence[Timeline]) -> float:
    """Seconds from the first event of any rank to the last."""
    t0, t1 = _window(list(timelines))
    return t1 - t0


def chrome_trace(timelines: Iterable[Timeline]) -> dict:
    """The Chrome trace event format (JSON object); one track per rank, times in microseconds."""
    timelines = sorted(timelines, key=lambda t: t.rank)
    t0, _ = _window(timelines)
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "threadpar pipeline"}}
    ]
    for t in timelines:
        name = f"stage {t.stage} (rank {t.rank})"
        events.append(dict(name="thread_name", ph="M", pid=0, tid=t.rank, args={"name": name}))
        events += [
            dict(
                name=e.name,
                cat=e.category,
                ph="X",
                pid=0,
                tid=t.rank,
                ts=(e.start - t0) * 1e6,
                dur=e.duration * 1e6,
            )
            for e in t.events
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, timelines: Iterable[Timeline]) -> None:
    """Write `chrome_trace(timelines)` to `path` (open it at https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)
