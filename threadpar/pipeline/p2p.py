"""Point-to-point between pipeline stages, with autograd: activations forward, their gradients back.

`send_activation(y, link, ...)` posts y to the next chunk's rank and returns an empty "token" tensor that
stands for y in this rank's graph: running backward from the token receives dL/dy from that rank and
continues this chunk's backward with it. `recv_activation(link, ...)` returns the activation posted by the
previous chunk's rank; backward through it sends the gradient back there. So each stage's backward runs on
its own rank (thread), and shapes and dtypes travel with the messages: no receive shapes, any dtype.

Every message carries a tag that encodes (microbatch, chunk, direction), so arrivals that come out of
order are never mixed up. The `Link` that the Functions capture holds the group handle, the peer and the
timeline: nothing is read from the rank's thread-local context (backward may run on another thread).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from threadpar.errors import CollectiveTimeoutError, ConfigError
from threadpar.pipeline.timeline import Timeline

# Tags live above 2**30 (clear of small user tags) and below 2**31 (what any backend's int tag can hold):
# bit 0 is the direction, bits 1-10 the chunk, bits 11-29 the microbatch.
TAG_BASE = 1 << 30
MAX_CHUNKS = 1 << 10
MAX_MICROBATCHES = 1 << 19


def message_tag(microbatch: int, chunk: int, backward: bool) -> int:
    """Tag of the message that crosses from chunk `chunk` to `chunk + 1` (forward) or back (backward)."""
    return TAG_BASE | (microbatch << 11) | (chunk << 1) | int(backward)


def describe_tag(tag: int) -> str:
    """Decode a tag: 2F3 is the activation of microbatch 3 out of chunk 2, 2B3 its gradient coming back."""
    rest = tag - TAG_BASE
    return f"{(rest >> 1) & (MAX_CHUNKS - 1)}{'B' if rest & 1 else 'F'}{rest >> 11}"


def check_tag_range(num_chunks: int, num_microbatches: int) -> None:
    if num_chunks > MAX_CHUNKS or num_microbatches > MAX_MICROBATCHES:
        raise ConfigError(
            f"pipeline message tags hold at most {MAX_CHUNKS} chunks and {MAX_MICROBATCHES} microbatches; "
            f"got {num_chunks} chunks and {num_microbatches} microbatches"
        )


def add_note(error: BaseException, text: str) -> None:
    """Attach `text` to an exception's report (Python 3.11+ notes; a no-op before)."""
    if hasattr(error, "add_note"):
        error.add_note(text)


class Channel(Protocol):
    """What a link needs from a group: ProcessGroup has both methods."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor: ...


class LocalChannel:
    """A pipeline of one rank (pp = 1, several chunks): messages to itself, kept in a dict."""

    def __init__(self) -> None:
        self._messages: dict[int, list[torch.Tensor]] = {}

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._messages.setdefault(tag, []).append(tensor.detach().clone())

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor:
        queue = self._messages.get(tag)
        if not queue:
            raise ConfigError(
                f"pipeline message {describe_tag(tag)} was never sent on this rank: the plan runs an action "
                "before the one that produces its input"
            )
        return queue.pop(0)


class Link:
    """This rank's connection to one neighbouring rank; captured by the autograd Functions."""

    def __init__(self, channel: Channel, peer: int, device: torch.device, timeline: Timeline | None = None):
        self.channel = channel
        self.peer = peer  # global rank
        self.device = device  # where received tensors must live
        self.timeline = timeline

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        t0 = time.perf_counter()
        self.channel.send(tensor.detach(), self.peer, tag)
        if self.timeline is not None:
            self.timeline.record(f"send {describe_tag(tag)}", "send", t0, time.perf_counter())

    def recv(self, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            tensor = self.channel.recv_tensor(self.peer, tag)
        except CollectiveTimeoutError as error:
            what = "gradient" if (tag - TAG_BASE) & 1 else "activation"
            add_note(
                error,
                f"(the pipeline was waiting for the {what} {describe_tag(tag)} from rank {self.peer}: "
                "did that rank fail, run another schedule, or leave its chunk's output unused?)",
            )
            raise
        if self.timeline is not None:
            self.timeline.record(f"recv {describe_tag(tag)}", "recv", t0, time.perf_counter())
        return tensor if tensor.device == self.device else tensor.to(self.device)


class _SendActivation(torch.autograd.Function):
    """Forward: post the activation to the next stage, return a token. Backward: receive its gradient."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, link: Link, forward_tag: int, backward_tag: int):
        link.send(activation, forward_tag)
        ctx.link, ctx.backward_tag = link, backward_tag
        return activation.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        return ctx.link.recv(ctx.backward_tag), None, None, None


class _RecvActivation(torch.autograd.Function):
    """Forward: receive the previous stage's activation. Backward: send the gradient back to it."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, link: Link, forward_tag: int, backward_tag: int):
        activation = link.recv(forward_tag)
        if not (activation.is_floating_point() or activation.is_complex()):
            ctx.mark_non_differentiable(activation)  # integer activations (token ids) carry no gradient
        ctx.link, ctx.backward_tag = link, backward_tag
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.link.send(grad, ctx.backward_tag)
        return None, None, None, None


def send_activation(activation: torch.Tensor, link: Link, *, chunk: int, microbatch: int) -> torch.Tensor:
    """Post chunk `chunk`'s output for `microbatch` to the rank of chunk + 1; return the token to run this
    chunk's backward from (`run_backward(token)`), or None when no gradient can flow (no grad mode)."""
    forward_tag = message_tag(microbatch, chunk, backward=False)
    if not (torch.is_grad_enabled() and activation.requires_grad):
        link.send(activation, forward_tag)
        return None
    return _SendActivation.apply(activation, link, forward_tag, message_tag(microbatch, chunk, True))


def recv_activation(link: Link, anchor: torch.Tensor | None, *, chunk: int, microbatch: int) -> torch.Tensor:
    """The input of chunk `chunk` for `microbatch`, from the rank of chunk - 1. With `anchor` (an empty leaf
    that requires grad) the result is part of the graph and its gradient goes back to that rank."""
    forward_tag = message_tag(microbatch, chunk - 1, backward=False)
    if anchor is None or not torch.is_grad_enabled():
        return link.recv(forward_tag)
    return _RecvActivation.apply(anchor, link, forward_tag, message_tag(microbatch, chunk - 1, True))


def run_backward(token: torch.Tensor) -> None:
    """Backward of one chunk and microbatch from the token `send_activation` returned."""
    torch.autograd.backward(token, token.new_empty(0))


def gradient_anchor(device: torch.device) -> torch.Tensor:
    """The empty leaf that makes received activations require grad (its own .grad stays None)."""
    return torch.empty(0, device=device, requires_grad=True)
