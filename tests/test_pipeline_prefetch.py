"""Receives posted ahead (PipelineParallel(prefetch=True)): the lowered plan posts each action's receive
before the compute action ahead of it, so that the transfer overlaps it (without prefetch: right before the
action itself); results are unchanged, and over a link whose transfers start once the receive is posted
(WireChannel) the time spent waiting for messages falls."""

import re
import threading
import time

import pytest
import torch
from test_pipeline_executor import (
    assert_matches_reference,
    lm_loss,
    make_batch,
    make_model,
    my_chunks,
    my_gradients,
    reference,
)

from benchmarks.pipeline import SleepChunk
from benchmarks.wire import WireClock, install_wire
from threadpar.pipeline import PipelineParallel, schedule_placement
from threadpar.pipeline.p2p import describe_tag
from threadpar.testing import run_ranks


class RecordingChannel:
    """A group that also accepts posted receives (as a rendezvous transport would) and records when each
    was posted; the message itself is taken when the receive is waited on."""

    def __init__(self, group, posts: list) -> None:
        self.group, self.posts = group, posts

    def send(self, tensor, dst, tag=0):
        self.group.send(tensor, dst, tag)

    def recv_tensor(self, src, tag=0, timeout=None):
        return self.group.recv_tensor(src, tag, timeout)

    def post_recv(self, src, tag):
        self.posts.append((describe_tag(tag), time.perf_counter()))
        return _Deferred(self, src, tag)


class _Deferred:
    def __init__(self, channel, src, tag) -> None:
        self.channel, self.src, self.tag = channel, src, tag

    def wait(self):
        return self.channel.group.recv_tensor(self.src, self.tag)


@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zb_interleaved", 2), ("zbv", 2)]
)
@pytest.mark.parametrize("prefetch", [True, False])
def test_each_receive_is_posted_before_the_action_ahead_of_the_one_that_needs_it(schedule, v, prefetch):
    pp, n = 2, 4
    num_layers = pp * v + 3  # (zbv: n >= 2 pp - 1 = 3)
    inputs, targets = make_batch(2 * n)
    ref_loss, ref_model = reference(num_layers, inputs, targets)

    def body():
        model = make_model(num_layers)
        chunks = my_chunks(model, v, schedule_placement(schedule))
        pipe = PipelineParallel(
            chunks, loss_fn=lm_loss, schedule=schedule, num_microbatches=n, prefetch=prefetch
        )
        posts: list = []
        for peer, link in pipe._links.items():
            if peer != pipe.stage:  # messages to itself (ZB-V's turn) stay local
                link.channel = RecordingChannel(link.channel, posts)
        loss = pipe.train_step(inputs, targets)
        events = pipe.timeline.events
        actions = [e for e in events if e.category in ("forward", "backward", "weight")]
        receives = [e for e in events if e.category == "recv"]
        posted = dict(posts)
        for recv in receives:
            message = recv.name.removeprefix("recv ")
            inside = next(a for a in actions if a.start <= recv.start and recv.end <= a.end)
            index = actions.index(inside)
            chunk = int(re.match(r"\d+", message).group())
            if pipe.plan.rank_of(chunk) == pipe.plan.rank_of(chunk + 1):
                continue  # a message to itself stays local
            previous = actions[index - 1] if index > 0 else None
            own_forward = previous is not None and previous.name == re.sub("[BI]", "F", inside.name)
            if prefetch and previous is not None and not own_forward:
                # posted before the previous action (so the transfer overlaps it), after the one before that
                earliest, latest = (actions[index - 2].end if index > 1 else 0.0), previous.start
            else:  # right before the action that needs it (a gradient's: after its own forward ran)
                earliest, latest = (previous.end if previous else 0.0), inside.start
            assert earliest <= posted[message] <= latest, (message, inside.name, prefetch)
        return {"loss": loss, "grads": my_gradients(model, chunks)}

    assert_matches_reference(run_ranks(body, pp, pp=pp), ref_loss, ref_model)


def test_posted_receives_cut_the_wait_for_messages_over_a_slow_wire():
    """4 stages, 1F1B, stages sleeping 40 ms forward and 40 ms backward; every message takes 30 ms once
    both sides have posted. Without prefetch each receive pays the transfer after it is posted; with it the
    transfer overlaps the previous action. Measured: the transfer time each rank waits out (WireChannel's
    `exposed`), which does not depend on how late the OS wakes the sleeping stages, with a wide margin."""
    pp, n = 4, 4
    lock = threading.Lock()
    clocks: dict[bool, WireClock] = {}

    def body(prefetch):
        pipe = PipelineParallel(
            SleepChunk(3, 0.04, 0.04, 0.0),
            loss_fn=lambda y, t: (y - t).square().mean(),
            num_microbatches=n,
            prefetch=prefetch,
        )
        with lock:
            clock = clocks.setdefault(prefetch, WireClock())
        wire = install_wire(pipe, 0.03, clock)
        pipe.train_step(torch.zeros(n, 3), torch.ones(n, 3))
        events = pipe.timeline.events
        return wire.exposed, sum(1 for e in events if e.category == "recv")

    waits = {flag: run_ranks(body, pp, flag, pp=pp) for flag in (False, True)}
    off, on = (sum(w for w, _ in waits[flag]) for flag in (False, True))
    messages = sum(count for _, count in waits[True])
    assert messages == 2 * n * (pp - 1)  # every activation and every gradient crossed once
    # off: every receive pays the whole transfer (24 x 30 ms); on: only those whose message was sent after
    # the receive was posted (the pipeline's fill and drain), about 15 of 24 here
    assert off > 0.5 * 0.03 * messages and on < 0.85 * off, (off, on, messages)


def test_prefetch_is_a_no_op_on_the_threads_backend_and_keeps_parity():
    inputs, targets = make_batch(8)
    ref_loss, ref_model = reference(5, inputs, targets)

    def body():
        model = make_model(5)
        chunks = my_chunks(model, 1)
        pipe = PipelineParallel(chunks, loss_fn=lm_loss, schedule="zbh1", num_microbatches=4, prefetch=True)
        assert not hasattr(pipe._from_prev.channel, "post_recv")  # buffered sends: nothing to post
        loss = pipe.train_step(inputs, targets)
        assert pipe._from_prev._posted == {} and pipe._to_next._posted == {}
        return {"loss": loss, "grads": my_gradients(model, chunks)}

    assert_matches_reference(run_ranks(body, 2, pp=2), ref_loss, ref_model)
