"""DDP communication hooks: how one bucket of gradients is reduced (torch's `register_comm_hook` API).

A hook is `hook(state, bucket: GradBucket) -> torch.futures.Future`. DDP calls it once per bucket per
synchronized backward, as soon as the bucket's gradients are all ready, on the backward thread and in
bucket order on every rank. It must start the bucket's collectives (asynchronously, on the process group it
was given: never look up the rank's context here) and return a future whose value says where the averages
are, in one of two ways:

- as torch's hooks do, one flat tensor shaped like `bucket.buffer()` (or a list whose first element is that
  tensor, as an all-reduce's future holds); DDP copies it into the gradients;
- the list `bucket.gradients()` itself (what `all_reduce_coalesced` on them returns): averaged in place.

`bucket.gradients()` are the parameters' gradients themselves (views into the bucket's buffer with
gradient_as_bucket_view). `bucket.buffer()` is one flat tensor; without bucket views DDP builds it, by
copying the gradients, only when a hook asks for it. The default hook never does: on the threads backend a
coalesced all-reduce averages a list of tensors in one collective, so buckets cost no copies at all.

Built-in hooks take a ProcessGroup as `state`; DDP passes its own group when registered with state=None.

    ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.group import ProcessGroup

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """One bucket as a comm hook sees it: the gradients of its parameters, and a flat buffer of them."""

    __slots__ = ("_buffer", "_flatten", "_gradients", "_index", "_is_last", "_parameters")

    def __init__(
        self,
        index: int,
        gradients: list[torch.Tensor],
        parameters: list[torch.nn.Parameter],
        is_last: bool,
        flatten: Callable[[], torch.Tensor],
    ) -> None:
        self._index, self._is_last, self._flatten = index, is_last, flatten
        self._gradients, self._parameters = gradients, parameters
        self._buffer: torch.Tensor | None = None

    def index(self) -> int:
        """The bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """This rank's gradients of the bucket as one flat 1-D tensor (built on first use)."""
        if self._buffer is None:
            self._buffer = self._flatten()
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """The gradients of the bucket's parameters, in bucket order (the tensors DDP writes back to)."""
        return self._gradients

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._parameters

    def is_last(self) -> bool:
        """True for the last bucket launched in a backward."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Overwrite the buffer's contents with `tensor` (same number of elements)."""
        buffer = self.buffer()
        buffer.copy_(tensor.reshape(buffer.shape))


def then(future: torch.futures.Future, fn: Callable[[Any], Any]) -> torch.futures.Future:
    """Like `future.then(lambda f: fn(f.value()))`, but an error reaches `wait()` with its own type (torch's
    `then` wraps it in a RuntimeError, which would hide e.g. that the rank was only stopped by a peer)."""
    chained: torch.futures.Future = torch.futures.Future()

    def run(done: torch.futures.Future) -> None:
        try:
            chained.set_result(fn(done.value()))
        except BaseException as error:
            chained.set_exception(error)

    future.add_done_callback(run)
    return chained


def allreduce_hook(process_group: ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """The default: average the bucket's gradients over the group in place, in one asynchronous collective."""
    work = process_group.all_reduce_coalesced(bucket.gradients(), ReduceOp.AVG, async_op=True)
    assert work is not None  # async_op=True returns a Work
    return work.get_future()


def _compressed_allreduce(
    process_group: ProcessGroup, bucket: GradBucket, dtype: torch.dtype
) -> torch.futures.Future:
    buffer = bucket.buffer()
    # Divide before summing, as torch's hooks do, so a sum of P values stays within fp16's range.
    compressed = buffer.to(dtype).div_(process_group.size())
    work = process_group.all_reduce(compressed, ReduceOp.SUM, async_op=True)
    assert work is not None  # async_op=True returns a Work

    def decompress(_: Any) -> torch.Tensor:
        # Runs on the communication worker, overlapping the rest of backward.
        return buffer.copy_(compressed)

    return then(work.get_future(), decompress)


def fp16_compress_hook(process_group: ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """Average in float16: half the bytes moved, about 3 significant digits kept."""
    return _compressed_allreduce(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
    """Average in bfloat16: half the bytes moved, float32's range, about 2-3 significant digits kept."""
    return _compressed_allreduce(process_group, bucket, torch.bfloat16)
