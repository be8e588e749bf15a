"""Point-to-point between pipeline stages, with autograd: activations forward, their gradients back.

`send_activation(y, link, ...)` posts y to the next chunk's rank and returns an empty "token" tensor that
stands for y in this rank's graph: running backward from the token receives dL/dy from that rank and
continues this chunk's backward with it. `recv_activation(link, ...)` returns the activation posted by the
previous chunk's rank; backward through it sends the gradient back there. So each stage's backward runs on
its own rank (thread), and shapes and dtypes travel with the messages: no receive shapes, any dtype.

y is a tensor (sent as it is: one message), or tensors and small constants nested in tuples, lists and
dicts (structure.py), sent as one packed message (packing.py) whose header says which leaves carry a
gradient back: floating-point leaves that require grad, as the sender decides. Their gradients come back
as one message too. A receiving stage whose backward never reached the activation (its chunk did not use
it) still owes the sender an answer: `settle_gradient` sends an empty one, so no side waits forever.

Every message carries a tag that encodes (microbatch, chunk, direction), so arrivals that come out of
order are never mixed up. The `Link` that the Functions capture holds the group handle, the peer and the
timeline: nothing is read from the rank's thread-local context (backward may run on another thread).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch

from threadpar.errors import CollectiveTimeoutError, ConfigError, add_note
from threadpar.pipeline.packing import is_packed, pack, pack_gradients, unpack, unpack_gradients
from threadpar.pipeline.structure import flatten, unflatten
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


class Channel(Protocol):
    """What a link needs from a group: ProcessGroup has both methods.

    A channel may also have `post_recv(src, tag) -> PostedReceive`: a receive posted ahead, whose transfer
    may proceed while this rank computes. A transport where data moves only once the receive is posted
    needs it (NCCL: ncclSend "is blocking for the GPU" until the peer's matching ncclRecv runs, per its
    documentation of ncclSend/ncclRecv). threadpar's own backends buffer every send at once, so for them a
    posted receive would change nothing and they have no post_recv."""

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    def recv_tensor(self, src: int, tag: int = 0, timeout: float | None = None) -> torch.Tensor: ...


class PostedReceive(Protocol):
    def wait(self) -> torch.Tensor: ...


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
        # Tags of the gradients this rank still owes the peer for activations it received with autograd.
        # Touched by the rank thread and by its backward, which may run on an autograd engine thread: every
        # access holds `_owed_lock` (DESIGN.md rule 10: nothing relies on the GIL to make it atomic).
        self.owed: set[int] = set()
        self._owed_lock = threading.Lock()
        # Receives posted ahead (prefetch), by tag; the lock because backward may run on another thread.
        self._posted: dict[int, PostedReceive] = {}
        self._lock = threading.Lock()

    def post(self, tag: int) -> None:
        """Post the receive of `tag` now, if the channel can (see Channel); `recv(tag)` then waits on it."""
        post_recv = getattr(self.channel, "post_recv", None)
        if post_recv is None:
            return
        with self._lock:
            if tag not in self._posted:
                self._posted[tag] = post_recv(self.peer, tag)

    def skip(self, tag: int, send: bool) -> None:
        """Message `tag` to (`send`) or from the peer does not come this step (a channel that launches messages
        in a planned order passes over it: pipeline/transport.py)."""
        skip = getattr(self.channel, "skip", None)
        if skip is not None:
            skip(self.peer, tag, send)

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        t0 = time.perf_counter()
        self.channel.send(tensor.detach(), self.peer, tag)
        if self.timeline is not None:
            self.timeline.record(f"send {describe_tag(tag)}", "send", t0, time.perf_counter())

    def owe(self, tag: int) -> None:
        with self._owed_lock:
            self.owed.add(tag)

    def owes(self, tag: int | None = None) -> bool:
        """Whether this rank still owes the peer the gradient `tag` (None: any gradient)."""
        with self._owed_lock:
            return bool(self.owed) if tag is None else tag in self.owed

    def pay(self, gradient: torch.Tensor, tag: int) -> None:
        """Send a gradient this rank owes the peer."""
        with self._owed_lock:
            self.owed.discard(tag)
        self.send(gradient, tag)

    def recv(self, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._lock:
            posted = self._posted.pop(tag, None)
        try:
            tensor = self.channel.recv_tensor(self.peer, tag) if posted is None else posted.wait()
        except CollectiveTimeoutError as error:
            what = "gradient" if (tag - TAG_BASE) & 1 else "activation"
            add_note(
                error,
                f"(the pipeline was waiting for the {what} {describe_tag(tag)} from rank {self.peer}: "
                "did that rank fail, or run another schedule?)",
            )
            raise
        if self.timeline is not None:
            self.timeline.record(f"recv {describe_tag(tag)}", "recv", t0, time.perf_counter())
        return tensor if tensor.device == self.device else tensor.to(self.device)


def _is_differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _no_gradient(device: torch.device) -> torch.Tensor:
    """The gradient message that says "no gradient reached this activation" (it has no bytes)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


class _SendActivation(torch.autograd.Function):
    """Forward: post the activation to the next stage, return a token. Backward: receive its gradient."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, link: Link, forward_tag: int, backward_tag: int):
        link.send(activation, forward_tag)
        ctx.link, ctx.backward_tag = link, backward_tag
        ctx.tensor_inputs = (0,)  # see output_gradients
        return activation.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        grad = ctx.link.recv(ctx.backward_tag)
        return (grad if grad.numel() else None), None, None, None  # empty: no gradient reached it


class _DropGradient(torch.autograd.Function):
    """A token for an activation that needs no gradient but gets one (a plain floating-point tensor: its
    receiver cannot tell): backward takes that message and drops it, so none is left behind."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, link: Link, backward_tag: int):
        ctx.link, ctx.backward_tag = link, backward_tag
        ctx.tensor_inputs = (0,)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        ctx.link.recv(ctx.backward_tag)
        return None, None, None


class _SendLeaves(torch.autograd.Function):
    """Forward: post a packed structure, return a token. Backward: receive the gradients of its
    gradient-carrying leaves (the inputs after `metas`), in one message."""

    @staticmethod
    def forward(ctx, link: Link, message: torch.Tensor, forward_tag: int, backward_tag: int, metas, *flagged):
        link.send(message, forward_tag)
        ctx.link, ctx.backward_tag, ctx.metas = link, backward_tag, metas
        ctx.tensor_inputs = (1, *range(5, 5 + len(flagged)))  # message, flagged
        return torch.empty(0, device=message.device)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        grads = unpack_gradients(ctx.link.recv(ctx.backward_tag), ctx.metas)
        return None, None, None, None, None, *grads


class _RecvActivation(torch.autograd.Function):
    """Forward: receive the previous stage's activation. Backward: send the gradient back to it.

    A plain message is returned as it is. For a packed one the outputs are its gradient-carrying leaves,
    and (spec, leaves, grad flags) goes into `unpacked` for the caller to rebuild the structure. The
    outputs are created here, not views of an input, so a chunk may modify them in place."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, link: Link, forward_tag: int, backward_tag: int, unpacked: list):
        message = link.recv(forward_tag)
        ctx.link, ctx.backward_tag, ctx.metas = link, backward_tag, None
        if not is_packed(message):  # `unpacked` stays empty: the caller takes the output as it is
            if _is_differentiable(message):
                link.owe(backward_tag)
            else:
                ctx.mark_non_differentiable(message)  # integer activations (token ids) carry no gradient
            return message
        spec, leaves, flags = unpack(message)
        unpacked.append((spec, leaves, flags))
        flagged = [leaf for leaf, flag in zip(leaves, flags) if flag]
        if not flagged:  # the sender waits for no gradient: nothing here is differentiable
            ctx.mark_non_differentiable(message)
            return message
        ctx.metas = [(t.dtype, tuple(t.shape)) for t in flagged]
        ctx.set_materialize_grads(False)  # a leaf the chunk left unused: None, sent as zeros or not at all
        link.owe(backward_tag)
        return tuple(flagged)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        link = ctx.link
        if ctx.metas is None:
            message = grads[0]  # a plain activation's gradient (materialized: never None)
        else:
            message = pack_gradients(grads, ctx.metas, link.device)
        link.pay(message, ctx.backward_tag)
        return None, None, None, None, None


def send_activation(activation: Any, link: Link, *, chunk: int, microbatch: int) -> torch.Tensor | None:
    """Post chunk `chunk`'s output for `microbatch` to the rank of chunk + 1; return the token to run this
    chunk's backward from (`run_backward(token)`), or None when no gradient comes back (no grad mode, or no
    leaf that requires grad in a structure)."""
    forward_tag, backward_tag = message_tag(microbatch, chunk, False), message_tag(microbatch, chunk, True)
    grad_mode = torch.is_grad_enabled()
    if isinstance(activation, torch.Tensor) and not is_packed(activation):  # the common case: as it is
        if grad_mode and activation.requires_grad:
            return _SendActivation.apply(activation, link, forward_tag, backward_tag)
        link.send(activation, forward_tag)
        if grad_mode and _is_differentiable(activation):  # e.g. out of a frozen chunk
            anchor = torch.empty(0, device=activation.device, requires_grad=True)
            return _DropGradient.apply(anchor, link, backward_tag)
        return None
    spec, leaves = flatten(activation, f"the output of chunk {chunk}")
    flags = [grad_mode and t.requires_grad and _is_differentiable(t) for t in leaves]
    with torch.no_grad():
        message = pack(spec, leaves, flags, link.device)
    flagged = [t for t, flag in zip(leaves, flags) if flag]
    if not flagged:
        link.send(message, forward_tag)
        return None
    metas = [(t.dtype, tuple(t.shape)) for t in flagged]
    return _SendLeaves.apply(link, message, forward_tag, backward_tag, metas, *flagged)


def recv_activation(link: Link, anchor: torch.Tensor | None, *, chunk: int, microbatch: int) -> Any:
    """The input of chunk `chunk` for `microbatch`, from the rank of chunk - 1: a tensor or the structure
    the previous chunk returned. With `anchor` (an empty leaf that requires grad) its gradient-carrying
    tensors are part of the graph and their gradients go back to that rank; call `settle_gradient` after
    this chunk's backward."""
    forward_tag = message_tag(microbatch, chunk - 1, backward=False)
    if anchor is None or not torch.is_grad_enabled():
        message = link.recv(forward_tag)
        if not is_packed(message):
            return message
        spec, leaves, _ = unpack(message)
        return unflatten(spec, leaves)
    unpacked: list = []
    outputs = _RecvActivation.apply(
        anchor, link, forward_tag, message_tag(microbatch, chunk - 1, True), unpacked
    )
    if not unpacked:
        return outputs
    spec, leaves, flags = unpacked[0]
    if any(flags):  # put the outputs, which are part of the graph, in the place of their leaves
        attached = iter(outputs)
        leaves = [next(attached) if flag else leaf for leaf, flag in zip(leaves, flags)]
    return unflatten(spec, leaves)


def settle_gradient(link: Link, *, chunk: int, microbatch: int) -> None:
    """After chunk `chunk`'s backward of `microbatch`: if it never reached the received activation (the
    chunk did not use its gradient-carrying part), tell the previous rank that no gradient comes."""
    if not link.owes():  # the usual case once a backward has sent its gradient: nothing to compute
        return
    tag = message_tag(microbatch, chunk - 1, backward=True)
    if link.owes(tag):  # only the rank thread pays this tag here: its backward has finished
        link.pay(_no_gradient(link.device), tag)


def output_gradients(token: torch.Tensor) -> list[tuple[Any, int, torch.Tensor]]:
    """Receive dL/d(output) for the token of a send, without running anything else: each gradient that
    arrived with the graph edge (node, output number) it continues on. The token's node is called directly,
    not through the engine: asked for its inputs' edges, the engine would also run the nodes between them
    (an output computed from another one) and sum their gradients in. A custom Function node has one edge
    per tensor argument of its forward, in order; `tensor_inputs` says which arguments those were."""
    node: Any = token.grad_fn  # a custom Function's node: it has apply() and what its forward put in ctx
    grads = node.apply(token.new_empty(0))
    pairs = []
    for (child, nr), position in zip(node.next_functions, node.tensor_inputs):
        grad = grads[position]
        if child is not None and grad is not None:
            pairs.append((child, nr, grad))
    return pairs


def run_backward(token: torch.Tensor) -> None:
    """Backward of one chunk and microbatch from the token `send_activation` returned."""
    torch.autograd.backward(token, token.new_empty(0))


def gradient_anchor(device: torch.device) -> torch.Tensor:
    """The empty leaf that makes received activations require grad (its own .grad stays None)."""
    return torch.empty(0, device=device, requires_grad=True)
