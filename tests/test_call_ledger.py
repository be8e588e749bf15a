"""The call ledger (comm/common/call_ledger.py): collectives matched in order without a meeting, from many
threads at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from threadpar.comm.common.call_ledger import CallLedger
from threadpar.comm.common.rendezvous import Call
from threadpar.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(60)

SUM4 = Call("all_reduce", torch.float32, (4,), (("op", "sum"),))


def test_the_member_whose_call_differs_from_the_first_raises_naming_both():
    ledger = CallLedger("TP", [4, 5, 6])
    assert not ledger.enter(0, 1, SUM4)
    with pytest.raises(CollectiveMismatchError) as raised:
        ledger.enter(1, 1, Call("all_reduce", torch.float32, (8,), (("op", "sum"),)))
    text = str(raised.value)
    assert "group 'TP' (global ranks [4, 5, 6]) at its call #1" in text
    assert "rank 4: all_reduce(float32[4]" in text
    assert "rank 5: all_reduce(float32[8]" in text and "<-- differs from rank 4" in text


BCAST4 = Call("broadcast", torch.float32, (4,), (("src", 0),))


@pytest.mark.parametrize("order", [(1, 0, 2), (0, 1, 2), (2, 0, 1), (0, 2, 1)])
def test_the_minority_is_named_whatever_order_the_members_come_in(order):
    """Ranks 0 and 2 call all_reduce, rank 1 broadcast: every raise names rank 1's call as the one that differs
    (a member whose call differs waits for the others' entries before it raises), whoever came first."""
    ledger = CallLedger("W", [0, 1, 2], wait_s=10.0)
    calls = {0: SUM4, 1: BCAST4, 2: SUM4}
    raised: dict[int, str] = {}

    def member(m: int) -> None:
        try:
            ledger.enter(m, 1, calls[m])
        except CollectiveMismatchError as error:
            raised[m] = str(error)

    def entered(m: int, thread: threading.Thread) -> bool:
        slot = ledger._slots.get(1)  # (a differing member waits in enter() once its entry is in the slot)
        return not thread.is_alive() or (slot is not None and m in slot.entered())

    threads = []
    for m in order:  # each member enters only once the previous one has
        threads.append(threading.Thread(target=member, args=(m,)))
        threads[-1].start()
        while not entered(m, threads[-1]):
            time.sleep(0.001)
    for t in threads:
        t.join()
    assert raised, "a mismatch raised nowhere"
    for text in raised.values():
        assert "rank 1: broadcast(float32[4], src=0)   <-- differs from ranks 0, 2" in text
        assert "rank 0: all_reduce(float32[4], op=sum)\n" in text + "\n"  # (not marked)
        assert "rank 2: all_reduce(float32[4], op=sum)\n" in text + "\n"


def test_without_a_majority_every_side_is_named():
    ledger = CallLedger("P", [0, 1])
    ledger.enter(0, 1, SUM4)
    with pytest.raises(CollectiveMismatchError) as raised:
        ledger.enter(1, 1, BCAST4)
    text = str(raised.value)
    assert "rank 0: all_reduce(float32[4], op=sum)   <-- differs from rank 1" in text
    assert "rank 1: broadcast(float32[4], src=0)   <-- differs from rank 0" in text


def test_calls_that_may_differ_are_compared_whole_by_the_member_that_completes_them():
    seen = []

    def sizes_agree(calls, members):
        seen.append([c.extra for c in calls])
        return None if calls[0].extra[0][1] + calls[1].extra[0][1] == 3 else "sizes do not add up"

    ledger = CallLedger("EP", [0, 1])
    ledger.compare_with("all_to_all", sizes_agree)
    assert not ledger.enter(1, 1, Call("all_to_all", extra=(("n", 2),)))
    assert ledger.enter(0, 1, Call("all_to_all", extra=(("n", 1),)))
    assert seen == [[(("n", 1),), (("n", 2),)]]  # in member order, whoever came first
    ledger.enter(0, 2, Call("all_to_all", extra=(("n", 1),)))
    with pytest.raises(CollectiveMismatchError, match="sizes do not add up"):
        ledger.enter(1, 2, Call("all_to_all", extra=(("n", 5),)))


def test_missing_and_overdue_name_who_has_not_issued_a_call():
    ledger = CallLedger("DP", [0, 1, 2])
    ledger.enter(2, 7, SUM4)
    ledger.enter(0, 7, SUM4)
    assert ledger.missing(7) == [1]
    assert ledger.missing(8) == []
    (late,) = ledger.overdue(0.0)
    assert (late.seq, late.call, late.issued, late.missing) == (7, SUM4, [0, 2], [1])
    assert ledger.overdue(3600.0) == []
    assert ledger.enter(1, 7, SUM4)
    assert ledger.missing(7) == [] and ledger.overdue(0.0) == []


def test_many_threads_entering_at_once_complete_each_call_exactly_once():
    members, calls = 8, 3000
    ledger = CallLedger("W", range(members))
    completed = [[] for _ in range(members)]
    start = threading.Barrier(members)

    def member(m: int) -> None:
        start.wait()
        for seq in range(calls):
            if ledger.enter(m, seq, SUM4):
                completed[m].append(seq)

    threads = [threading.Thread(target=member, args=(m,)) for m in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seq for done in completed for seq in done) == list(range(calls))
    assert ledger.overdue(0.0) == []  # (every slot closed)
