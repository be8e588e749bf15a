"""`C10dWork`: a threadpar Work as torch.distributed's `Work` (what c10d's ops and functional collectives wait on).

A Python subclass of `torch.distributed.Work`: c10d's C++ calls `wait()` and `get_future()` through its
trampoline (torch/csrc/distributed/c10d/PyProcessGroup.hpp, PyWork), Python callers reach every method.
`wait()` is the threadpar Work's: on the threads backend it blocks until the op is done (waking on the
launch's stop signal), on nccl it orders the caller's current stream after the collective, as c10d's
NCCL Work does. The Work holds the op's tensors until it is waited on (the nccl backend also records them
on its comm stream), so a caller that drops its tensors early cannot free memory still in use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from threadpar.comm.common.work import OrderedFuture, Work


class C10dWork(dist.Work):
    def __init__(
        self,
        works: Sequence[Work],
        outputs: list[torch.Tensor],
        *,
        stream_ordered: bool,
        then: Callable[[], None] | None = None,
        source: Callable[[], int] | None = None,
        same_future: bool = False,
    ) -> None:
        super().__init__()
        self._works = list(works)  # every threadpar op this c10d op issued (several for a coalesced one)
        self._outputs = outputs  # c10d's result (get_future().value()); also keeps the tensors alive
        self._stream_ordered = stream_ordered
        self._then = then  # runs once after the ops, on the waiting thread (e.g. copy a staged result out)
        self._source = source
        self._waited = False
        # The one threadpar Work's own future already has c10d's value (an all-reduce's tensors): hand it
        # out as it is, without a Python callback on completion (DDP asks for one per bucket).
        self._same_future = same_future and len(self._works) == 1

    def wait(self, timeout: timedelta | None = None) -> bool:
        """A timeout (c10d passes timedelta(0) for none) makes the host wait at most that long for the op
        (on nccl: for the device too) and raise CollectiveTimeoutError after, as c10d's wait(timeout)."""
        seconds = timeout.total_seconds() if timeout else 0.0
        limit = seconds if seconds > 0 else None
        if not self._waited:
            for work in self._works:
                work.wait(limit)
            if self._then is not None:
                self._then()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        for work in self._works:
            error = work.exception()
            if error is not None:
                return error
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        for work in self._works:
            work.synchronize()
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A Future whose value is the op's output tensors. On the threads backend it completes when the op
        does (`then` waits for it and runs its callback on the calling thread: OrderedFuture); on nccl it
        is completed after `wait()` has ordered the caller's stream, as c10d's CUDA futures are usable on
        the current stream."""
        if self._stream_ordered or not self._works or self._then is not None:
            future: torch.futures.Future = torch.futures.Future()
            try:
                self.wait()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(self._outputs)
            return future
        if self._same_future:
            return self._works[0].get_future()
        works, outputs = self._works, self._outputs
        futures = [w.get_future() for w in works]
        future = OrderedFuture(lambda: _wait_all_done(works))

        def complete(_: torch.futures.Future) -> None:
            try:
                for f in futures:
                    f.wait()  # re-raises an op's error into the returned future
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(outputs)

        torch.futures.collect_all(futures).add_done_callback(complete)
        return future

    def _source_rank(self) -> int:
        """For a receive from any source: the sender's rank in the group (c10d's Work::sourceRank)."""
        if self._source is None:
            raise RuntimeError("_source_rank() is only defined for the Work of a receive")
        self.wait()
        return self._source()

    source_rank = _source_rank


def _wait_all_done(works: Sequence[Work]) -> None:
    for work in works:
        work.wait_done()


def completed(outputs: list[torch.Tensor]) -> C10dWork:
    """The Work of an op that finished before it was returned."""
    return C10dWork([], outputs, stream_ordered=False)
