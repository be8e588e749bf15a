"""`GcSchedule`: Python's cyclic garbage collector at step boundaries, not wherever allocations trip it.

The collector is process-wide and holds the GIL while it runs, so in one process it stops every rank thread
at once, at whatever point of its step each one is. Torch's objects make it dear: in the demo's process
(about 340k tracked objects) an automatic full collection took some 80 ms, half a step, and the young
collections about 1% of every step. Training loops rarely make reference cycles that must go at once, so
the remedy torchtitan (`GarbageCollection`, `gc_freq`) and Megatron (`--manual-gc`) apply is kept: turn
the automatic collector off for the run and collect every `every` steps, from one thread.

    with threadpar.GcSchedule(every=50) as gc_schedule:
        threadpar.launch(train, ...)   # each rank thread calls gc_schedule.step(step) after its step

`step(i)` may be called by every rank thread: the first call for a step i that is a multiple of `every`
collects; the others for the same i (or an earlier one) return at once (a lock guards the record, no GIL assumed). A
collection of generation 1 (the young objects and those that survived one collection), as torchtitan
does: a full one walks every object torch ever made. Nested schedules (a notebook that launches inside
a launch) share the one collector: it is re-enabled when the outermost exits, and only if it was on.
"""

from __future__ import annotations

import gc
import threading
from types import TracebackType

from threadpar.errors import ConfigError

_lock = threading.Lock()  # guards _depth and the collector's on/off state across schedules
_depth = 0
_was_enabled = False


class GcSchedule:
    def __init__(self, every: int = 50, generation: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(
                f"GcSchedule(every={every!r}): need a positive number of steps between collections"
            )
        if generation not in (0, 1, 2):
            raise ConfigError(
                f"GcSchedule(generation={generation!r}): Python's collector has generations 0, 1, 2"
            )
        self.every = every
        self.generation = generation
        self._lock = threading.Lock()  # guards _last
        self._last: int | None = None  # the last step index collected at
        self.collections = 0

    def __enter__(self) -> GcSchedule:
        global _depth, _was_enabled
        with _lock:
            if _depth == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _depth += 1
        gc.collect(self.generation)  # start the run with the setup's garbage gone
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

    def step(self, step: int) -> bool:
        """After step `step` (0-based): collect if step + 1 is a multiple of `every` and no other thread has
        collected for this step yet. Returns whether this call collected."""
        if (step + 1) % self.every:
            return False
        with self._lock:
            if self._last is not None and self._last >= step:
                return False  # another rank thread collected for this step (or a later one)
            self._last = step
            self.collections += 1
        gc.collect(self.generation)
        return True
