"""Timeline arithmetic on hand-made events: compute time, measured bubble, Chrome trace."""

import json

import pytest

from threadpar.errors import ConfigError
from threadpar.pipeline import Timeline, chrome_trace, measured_bubble, step_time, write_chrome_trace


def two_stage_step() -> list[Timeline]:
    # stage 0: 0F0 [0, 2) with a send inside; 0B0 [6, 8) waiting 1 s for the gradient
    first = Timeline(rank=0, stage=0)
    first.record("0F0", "forward", 0.0, 2.0)
    first.record("send 0F0", "send", 1.9, 2.0)
    first.record("0B0", "backward", 6.0, 8.0)
    first.record("recv 0B0", "recv", 6.0, 7.0)
    # stage 1: 1F0 [0, 4) of which 2 s waiting for the activation; 1B0 [4, 6)
    second = Timeline(rank=1, stage=1)
    second.record("1F0", "forward", 0.0, 4.0)
    second.record("recv 0F0", "recv", 0.0, 2.0)
    second.record("1B0", "backward", 4.0, 6.0)
    return [first, second]


def test_compute_excludes_the_messages_inside_actions():
    first, second = two_stage_step()
    assert first.action_costs() == pytest.approx({"0F0": 1.9, "0B0": 1.0})
    assert second.action_costs() == pytest.approx({"1F0": 2.0, "1B0": 2.0})
    assert first.compute_time() == pytest.approx(2.9)
    assert step_time([first, second]) == 8.0
    # busy 2.9 + 4.0 out of 2 ranks x 8 s
    assert measured_bubble([first, second]) == pytest.approx(1 - 6.9 / 16)


def test_snapshot_survives_the_next_step():
    first, _ = two_stage_step()
    kept = first.snapshot()
    first.clear()
    assert first.events == [] and len(kept.events) == 4


def test_chrome_trace_has_one_track_per_rank_in_microseconds(tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace(path, two_stage_step())
    trace = json.loads(path.read_text())
    spans = {(e["tid"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert len(spans) == 7
    assert spans[(1, "1B0")]["ts"] == 4e6 and spans[(1, "1B0")]["dur"] == 2e6
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "stage 0 (rank 0)", 1: "stage 1 (rank 1)"}


def test_an_empty_timeline_says_to_run_a_step_first():
    with pytest.raises(ConfigError, match="run a pipeline step first"):
        measured_bubble([Timeline(0, 0)])
    with pytest.raises(ConfigError):
        chrome_trace([])
