"""Autograd send/recv between pipeline ranks: any dtype, no receive shapes, tags that keep messages apart."""

import threading

import pytest
import torch

import threadpar
from threadpar.errors import CollectiveTimeoutError
from threadpar.pipeline import Link, describe_tag, message_tag, recv_activation, send_activation
from threadpar.pipeline.p2p import MAX_CHUNKS, MAX_MICROBATCHES, gradient_anchor, run_backward
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
