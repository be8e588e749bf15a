"""Autograd send/recv between pipeline ranks: any dtype, no receive shapes, tags that keep messages apart."""

import threading

import pytest
import torch

import threadpar
from threadpar.errors import CollectiveTimeoutError
from threadpar.pipeline import Link, Timeline, describe_tag, message_tag, recv_activation, send_activation
from threadpar.pipeline.p2p import (
    MAX_CHUNKS,
    MAX_MICROBATCHES,
    gradient_anchor,
    run_backward,
    settle_gradient,
)
from threadpar.testing import run_ranks


def link_to(peer: int) -> Link:
    return Link(threadpar.get_group(), peer, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_activation_forward_and_gradient_back_in_any_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, generator=g).to(dtype)
    w0 = torch.randn(3, 5, 2, generator=g).to(dtype)
    c = torch.randn(3, 5, 2, generator=g).to(dtype)

    def body():
        if threadpar.get_rank() == 0:
            w = w0.clone().requires_grad_()
            y = x * w
            seen = []
            y.register_hook(lambda grad: seen.append(threading.current_thread().name))
            token = send_activation(y, link_to(1), chunk=0, microbatch=0)
            run_backward(token)  # receives dL/dy from rank 1
            return w.grad, seen
        received = recv_activation(link_to(0), gradient_anchor(torch.device("cpu")), chunk=1, microbatch=0)
        assert received.shape == (3, 5, 2) and received.dtype == dtype and received.requires_grad
        (received * c).sum().backward()  # sends dL/dy back to rank 0
        return None

    grad, threads = run_ranks(body, 2)[0]
    w = w0.clone().requires_grad_()
    (x * w * c).sum().backward()
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, w.grad)
    assert threads == ["threadpar-rank-0"]  # this stage's backward ran on its own rank thread


def test_out_of_order_arrivals_are_never_mixed():
    def body():
        rank = threadpar.get_rank()
        if rank == 0:
            # first a gradient message with the same microbatch and chunk, but the other direction
            link_to(1).send(torch.full((2,), -1.0), message_tag(0, 0, backward=True))
            for mb in (2, 0, 1):
                send_activation(torch.full((2,), float(mb)), link_to(1), chunk=0, microbatch=mb)
            return None
        got = [recv_activation(link_to(0), None, chunk=1, microbatch=mb)[0].item() for mb in (0, 1, 2)]
        return got

    assert run_ranks(body, 2)[1] == [0.0, 1.0, 2.0]


def test_integer_activations_pass_without_gradient():
    def body():
        if threadpar.get_rank() == 0:
            send_activation(torch.arange(6).view(2, 3), link_to(1), chunk=0, microbatch=0)
            return None
        anchor = gradient_anchor(torch.device("cpu"))
        return recv_activation(link_to(0), anchor, chunk=1, microbatch=0)

    tokens = run_ranks(body, 2)[1]
    assert tokens.dtype == torch.int64 and not tokens.requires_grad
    torch.testing.assert_close(tokens, torch.arange(6).view(2, 3))


def test_tags_encode_microbatch_chunk_and_direction():
    tags = {
        message_tag(m, c, b): (m, c, b)
        for m in (0, 1, 7, MAX_MICROBATCHES - 1)
        for c in (0, 1, 5, MAX_CHUNKS - 1)
        for b in (False, True)
    }
    assert len(tags) == 4 * 4 * 2
    assert all(2**30 <= t < 2**31 for t in tags)  # clear of user tags, fits an int32
    assert describe_tag(message_tag(3, 2, False)) == "2F3"
    assert describe_tag(message_tag(12, 0, True)) == "0B12"


def test_a_missing_activation_times_out_naming_it():
    def body():
        if threadpar.get_rank() == 1:
            recv_activation(link_to(0), None, chunk=3, microbatch=5)

    with pytest.raises(CollectiveTimeoutError) as caught:
        run_ranks(body, 2, timeout=0.3)
    assert "waiting for the activation 2F5 from rank 0" in "\n".join(caught.value.__notes__)


def recording_link(peer: int) -> Link:
    return Link(threadpar.get_group(), peer, torch.device("cpu"), Timeline(threadpar.get_rank(), 0))


def test_a_structure_goes_forward_in_one_message_and_only_its_differentiable_leaves_get_gradients():
    """{"h": fp32 requiring grad, "ids": int64, "r": bf16 requiring grad, "d": detached fp32, "unused": fp32
    requiring grad that the receiver ignores, "k": 3, "n": None} in one message; gradients for h, r and
    unused (zeros) in one message back."""
    g = torch.Generator().manual_seed(0)
    x, w0, c = (torch.randn(3, 4, generator=g) for _ in range(3))
    ids = torch.tensor([[1, 2], [3, 4]])

    def structure(w):
        y = x * w
        return {
            "h": y,
            "ids": ids,
            "pair": (y.to(torch.bfloat16), y.detach() + 1),
            "unused": [y * 2],
            "k": 3,
            "n": None,
        }

    def loss(s):
        return (s["h"] * c).sum() + (s["pair"][0].float() * c * 3).sum() + s["ids"].sum() * 0

    def body():
        if threadpar.get_rank() == 0:
            w = w0.clone().requires_grad_()
            link = recording_link(1)
            token = send_activation(structure(w), link, chunk=0, microbatch=0)
            run_backward(token)
            return w.grad, [e.name for e in link.timeline.events]
        link = recording_link(0)
        got = recv_activation(link, gradient_anchor(torch.device("cpu")), chunk=1, microbatch=0)
        assert set(got) == {"h", "ids", "pair", "unused", "k", "n"} and got["k"] == 3 and got["n"] is None
        assert isinstance(got["pair"], tuple) and isinstance(got["unused"], list)
        dtypes = [got["h"].dtype, got["ids"].dtype, got["pair"][0].dtype, got["pair"][1].dtype]
        assert dtypes == [torch.float32, torch.int64, torch.bfloat16, torch.float32]
        leaves = [got["h"], got["ids"], got["pair"][0], got["pair"][1], got["unused"][0]]
        assert [t.requires_grad for t in leaves] == [True, False, True, False, True]
        torch.testing.assert_close(got["ids"], ids)
        torch.testing.assert_close(got["pair"][1], x * w0 + 1)
        got["h"].mul_(1.0)  # received leaves may be modified in place, like a plain activation
        loss(got).backward()
        settle_gradient(link, chunk=1, microbatch=0)  # already sent by the backward: sends nothing more
        return None, [e.name for e in link.timeline.events]

    (grad, sender_events), (_, receiver_events) = run_ranks(body, 2)
    assert sender_events == ["send 0F0", "recv 0B0"] and receiver_events == ["recv 0F0", "send 0B0"]
    w = w0.clone().requires_grad_()
    loss(structure(w)).backward()
    torch.testing.assert_close(grad, w.grad)


def test_a_receiver_that_uses_no_differentiable_leaf_settles_and_the_sender_gets_no_gradient():
    def body():
        w = torch.ones(2, requires_grad=True)
        if threadpar.get_rank() == 0:
            token = send_activation((w * 2, torch.arange(2)), link_to(1), chunk=0, microbatch=0)
            run_backward(token)  # would time out if rank 1 did not settle
            return w.grad
        link = link_to(0)
        hidden, ids = recv_activation(link, gradient_anchor(torch.device("cpu")), chunk=1, microbatch=0)
        assert hidden.requires_grad and not ids.requires_grad
        (ids.float() * w).sum().backward()  # the received hidden is not used
        settle_gradient(link, chunk=1, microbatch=0)
        return w.grad

    sender_grad, receiver_grad = run_ranks(body, 2, timeout=5)
    assert sender_grad is None
    torch.testing.assert_close(receiver_grad, torch.tensor([0.0, 1.0]))


def test_a_structure_without_differentiable_leaves_needs_no_gradient_message():
    def body():
        w = torch.ones(2, requires_grad=True)
        if threadpar.get_rank() == 0:
            with torch.no_grad():
                detached = w * 2
            token = send_activation([detached, torch.arange(2)], link_to(1), chunk=0, microbatch=0)
            return token
        link = link_to(0)
        got = recv_activation(link, gradient_anchor(torch.device("cpu")), chunk=1, microbatch=0)
        assert isinstance(got, list) and not any(t.requires_grad for t in got)
        assert not link.owed  # nothing to settle
        return None

    assert run_ranks(body, 2, timeout=5) == [None, None]


def test_a_plain_tensor_that_looks_like_a_packed_message_still_arrives_as_itself():
    lookalike = torch.arange(5, dtype=torch.uint8).view(1, 1, 1, 1, 1, 1, 1, 5)

    def body():
        if threadpar.get_rank() == 0:
            send_activation(lookalike, link_to(1), chunk=0, microbatch=0)
            return None
        return recv_activation(link_to(0), None, chunk=1, microbatch=0)

    got = run_ranks(body, 2)[1]
    assert isinstance(got, torch.Tensor) and got.shape == lookalike.shape
    assert torch.equal(got, lookalike)
