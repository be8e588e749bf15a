"""threadpar.GcSchedule: the automatic collector is off inside, collections come at step boundaries, once per
step whatever the number of rank threads, and the collector's state is restored on the way out."""

from __future__ import annotations

import gc
import threading

import pytest

import threadpar
from threadpar.errors import ConfigError


@pytest.fixture
def collections():
    """The generations of the collections Python ran while the test ran (gc.callbacks)."""
    seen: list[int] = []
    lock = threading.Lock()

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            with lock:
                seen.append(info["generation"])

    gc.callbacks.append(on_gc)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_gc)


def test_collector_off_inside_and_restored_after():
    assert gc.isenabled()
    with threadpar.GcSchedule(every=3):
        assert not gc.isenabled()
        with threadpar.GcSchedule(every=5):  # nested: the inner exit must not turn it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restores_a_collector_that_was_off():
    gc.disable()
    try:
        with threadpar.GcSchedule(every=2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restored_when_the_body_raises():
    with pytest.raises(ValueError), threadpar.GcSchedule(every=2):
        raise ValueError("boom")
    assert gc.isenabled()


def test_collects_every_n_steps_once_per_step_from_any_number_of_threads(collections):
    schedule = threadpar.GcSchedule(every=3, generation=1)
    steps, threads = 9, 8
    collected = [0] * threads
    start = threading.Barrier(threads)

    def rank(i: int) -> None:
        start.wait()
        for step in range(steps):
            collected[i] += schedule.step(step)

    with schedule:
        collections.clear()  # the entry's own collection
        workers = [threading.Thread(target=rank, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        ran = list(collections)
    # After steps 2, 5, 8: three collections of generation 1, made by whichever thread came first.
    assert sum(collected) == 3 == schedule.collections
    assert ran == [1, 1, 1]


def test_a_late_thread_does_not_collect_again_for_an_earlier_step():
    schedule = threadpar.GcSchedule(every=2)
    with schedule:
        assert schedule.step(3)
        assert not schedule.step(1)  # a slower rank thread reaching step 1 after step 3 was collected
        assert not schedule.step(0)  # not a collection step
        assert schedule.step(5)
    assert schedule.collections == 2


def test_no_automatic_collection_inside(collections):
    with threadpar.GcSchedule(every=1000):
        collections.clear()
        for _ in range(20_000):  # far past the 700 allocations that trigger a generation-0 collection
            a: list = []
            a.append(a)  # a reference cycle: tracked, and left for the collector
        assert collections == []


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"every": 0}, "positive number of steps"),
        ({"every": True}, "positive number of steps"),
        ({"every": 2.5}, "positive number of steps"),
        ({"every": 5, "generation": 3}, "generations 0, 1, 2"),
    ],
)
def test_bad_arguments(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        threadpar.GcSchedule(**kwargs)
