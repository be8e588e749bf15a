"""Point-to-point: buffered mailboxes, ordering, tags, any-source, errors."""

import pytest
import torch

import threadpar
from threadpar.testing import run_ranks


def test_ring_exchange_where_everyone_sends_first_does_not_deadlock():
    def body():
        rank, n = threadpar.get_rank(), threadpar.get_world_size()
        threadpar.send(torch.tensor([float(rank)]), dst=(rank + 1) % n)
        got = torch.empty(1)
        src = threadpar.recv(got, src=(rank - 1) % n)
        return src, got.item()

    assert run_ranks(body, 4) == [(3, 3.0), (0, 0.0), (1, 1.0), (2, 2.0)]


def test_messages_keep_order_per_source_and_tag_and_tags_are_separate():
    def body():
        if threadpar.get_rank() == 0:
            for i in range(5):
                threadpar.send(torch.tensor([i]), dst=1, tag=7)
            threadpar.send(torch.tensor([99]), dst=1, tag=3)
            return None
        t = torch.empty(1, dtype=torch.int64)
        threadpar.recv(t, src=0, tag=3)
        first = t.item()
        seq = []
        for _ in range(5):
            threadpar.recv(t, src=0, tag=7)
            seq.append(t.item())
        return first, seq

    assert run_ranks(body, 2)[1] == (99, [0, 1, 2, 3, 4])


def test_sender_may_reuse_its_tensor_at_once():
    def body():
        if threadpar.get_rank() == 0:
            t = torch.ones(3)
            threadpar.send(t, dst=1)
            t.fill_(-1)  # must not change the message
            return None
        t = torch.empty(3)
        threadpar.recv(t, src=0)
        return t

    torch.testing.assert_close(run_ranks(body, 2)[1], torch.ones(3))


def test_isend_and_recv_tensor_carry_shape_and_dtype():
    def body():
        rank = threadpar.get_rank()
        if rank != 0:
            threadpar.isend(torch.full((rank, 2), rank, dtype=torch.bfloat16), dst=0).wait()
            return None
        world = threadpar.get_group()
        return [
            (tuple(m.shape), m.dtype, m[0, 0].item())
            for m in (world.recv_tensor(src=2), world.recv_tensor(src=1))
        ]

    assert run_ranks(body, 3)[0] == [((2, 2), torch.bfloat16, 2.0), ((1, 2), torch.bfloat16, 1.0)]


def test_irecv_completes_on_wait_and_any_source_reports_the_sender():
    def body():
        rank = threadpar.get_rank()
        if rank == 0:
            t = torch.empty(2)
            work = threadpar.irecv(t, src=None, tag=5)
            threadpar.barrier()  # rank 1 sends before the barrier
            assert work.wait() and work.is_completed()
            return work.result(), t
        if rank == 1:
            threadpar.send(torch.tensor([1.0, 2.0]), dst=0, tag=5)
        threadpar.barrier()
        return None

    src, t = run_ranks(body, 3)[0]
    assert src == 1
    torch.testing.assert_close(t, torch.tensor([1.0, 2.0]))


def test_recv_errors_are_clear():
    def body():
        rank = threadpar.get_rank()
        if rank == 0:
            threadpar.send(torch.zeros(2, 3), dst=1)
            with pytest.raises(threadpar.ConfigError, match="cannot send to or from itself"):
                threadpar.send(torch.zeros(1), dst=0)
            with pytest.raises(threadpar.ConfigError, match="dst=5 is not a member"):
                threadpar.send(torch.zeros(1), dst=5)
        else:
            with pytest.raises(threadpar.ConfigError, match=r"message from rank 0 is float32\[2, 3\]"):
                threadpar.recv(torch.empty(3), src=0)
            with pytest.raises(threadpar.CollectiveTimeoutError, match=r"from rank 0 .* no matching message"):
                threadpar.get_group().recv(torch.empty(1), src=0, tag=1, timeout=0.2)

    run_ranks(body, 2)


def test_receives_match_messages_in_posting_order_as_in_torch():
    """torch.distributed (c10d, NCCL) gives a peer's messages to receives in the order they were posted,
    whichever is waited on first; so does threadpar (waited in reverse, probed, mixed with a blocking recv)."""

    def body():
        rank = threadpar.get_rank()
        if rank == 1:
            for value in range(1, 7):
                threadpar.send(torch.tensor([float(value)]), dst=0)
            threadpar.barrier()  # every message is in rank 0's mailbox before it looks
            return None
        threadpar.barrier()
        a, b, c, d, e, f = (torch.zeros(1) for _ in range(6))
        first, second = threadpar.irecv(a, src=1), threadpar.irecv(b, src=1)
        second.wait()  # waited first, posted second: the second message
        first.wait()
        third, fourth = threadpar.irecv(c, src=1), threadpar.irecv(d, src=None)  # any source comes after
        probed = fourth.is_completed()  # the message is there: completes the earlier receive first
        fifth = threadpar.irecv(e, src=1)
        threadpar.recv(f, src=1)  # blocking, posted last: the sixth
        fifth.wait()
        return probed, third.is_completed(), [t.item() for t in (a, b, c, d, e, f)]

    assert run_ranks(body, 2)[0] == (True, True, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_a_failed_earlier_receive_keeps_its_error_and_the_later_one_gets_its_message():
    def body():
        if threadpar.get_rank() == 1:
            threadpar.send(torch.zeros(3), dst=0)
            threadpar.send(torch.ones(2), dst=0)
            return None
        wrong, right = torch.empty(5), torch.empty(2)
        earlier, later = threadpar.irecv(wrong, src=1), threadpar.irecv(right, src=1)
        later.wait()  # completes `earlier` first: its shape mismatch stays with it
        with pytest.raises(threadpar.ConfigError, match=r"message from rank 1 is float32\[3\]"):
            earlier.wait()
        return right

    torch.testing.assert_close(run_ranks(body, 2)[0], torch.ones(2))
