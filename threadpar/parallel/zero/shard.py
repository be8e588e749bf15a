"""One bucket as this rank's optimizer sees it: its range of the parameters (or their fp32 master copy),
the gradients for that range, and the all-gather that publishes the updated range to the group."""

from __future__ import annotations

import torch

from threadpar.comm.common.reduce_op import ReduceOp
from threadpar.comm.common.work import Work
from threadpar.parallel.zero.shard_bucket import ShardBucket

LOW_PRECISION = (torch.bfloat16, torch.float16)


class Shard:
    """This rank's range of `bucket`: `tensors[i]` is piece i (1-D), what the wrapped optimizer steps."""

    def __init__(self, bucket: ShardBucket, master_weights: bool) -> None:
        self.bucket = bucket
        bucket.take_storage()
        shard = bucket.shard()
        # bf16/fp16 parameters: the optimizer steps an fp32 copy of the range (master weights), and the
        # parameters get its rounded values after each step. Otherwise it steps the parameters themselves.
        self.master = shard.float() if master_weights and shard.dtype in LOW_PRECISION else None
        self.values = shard if self.master is None else self.master  # [S], what the optimizer updates
        self.tensors = [self.values[p.shard_offset : p.shard_offset + p.hi - p.lo] for p in bucket.pieces]
        self.grad_buffer: torch.Tensor | None = None  # [S] in the optimizer's dtype, when a copy is needed
        # ZeRO-2: per parameter, whether it got a gradient since zero_grad; whether grad_buffer holds one.
        self.has_grad = [False] * len(bucket.params)
        self.reduced = False
        self._pending: list[torch.Tensor] = []  # reduce-scatter outputs to add to grad_buffer
        # ZeRO-2, during a synchronizing backward: the bucket's gradients laid out like `flat` ([P * S]), filled
        # as each becomes ready (its param.grad is dropped then), the reduce-scatter's input.
        self._staging: torch.Tensor | None = None
        self._staged = [False] * len(bucket.params)

    # gradients ---------------------------------------------------------------------------------------------------
    def _buffer(self) -> torch.Tensor:
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros_like(self.values)
        return self.grad_buffer

    def grads_from_params(self) -> None:
        """ZeRO-1: the pieces' gradients from the parameters' (already averaged) gradients: views, or a copy
        into fp32 for master weights. A parameter without a gradient leaves its pieces without one."""
        copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for piece, tensor in zip(self.bucket.pieces, self.tensors):
            grad = self.bucket.params[piece.index].grad
            if grad is None:
                tensor.grad = None
                continue
            part = grad.reshape(-1)[piece.lo : piece.hi]
            if self.master is None:
                tensor.grad = part
            else:
                target = self._buffer()[piece.shard_offset : piece.shard_offset + piece.hi - piece.lo]
                copies[0].append(target)
                copies[1].append(part)
                tensor.grad = target
        if copies[0]:
            torch._foreach_copy_(copies[0], copies[1])

    @property
    def staging(self) -> bool:
        """Whether a backward has staged gradients of this bucket that are not reduced yet."""
        return self._staging is not None

    def stage_grad(self, index: int) -> None:
        """ZeRO-2: parameter `index` (of the bucket) has its gradient for this backward: copy it into the
        bucket's reduce-scatter input and drop param.grad, so that a full gradient lives only from its
        computation until this copy (as DeepSpeed's ZeRO-2 copies into its reduction bucket)."""
        param = self.bucket.params[index]
        grad = param.grad
        if grad is None:
            return  # unused here: reduce_scatter fills zeros
        if self._staging is None:
            self._staging = grad.new_empty(self.bucket.shard_size * self.bucket.group.size())  # [P * S]
            self._staged = [False] * len(self.bucket.params)
        start = self.bucket.offsets[index]
        self._staging[start : start + grad.numel()].copy_(grad.reshape(-1))
        self._staged[index] = True
        param.grad = None

    def reduce_scatter(self, scale: float, async_op: bool) -> Work | None:
        """ZeRO-2: average the staged gradients over the group, keeping this rank's range only. Parameters
        without a gradient on this rank count as zeros. The full input is let go of here: the collective
        holds it until it has run (on a GPU, the comm stream: record_stream)."""
        bucket = self.bucket
        flat, self._staging = self._staging, None
        if flat is None:
            first = bucket.params[0]
            flat = torch.zeros(
                bucket.shard_size * bucket.group.size(), dtype=first.dtype, device=first.device
            )
        else:
            for i, (param, start) in enumerate(zip(bucket.params, bucket.offsets)):
                if not self._staged[i]:
                    flat[start : start + param.numel()].zero_()
            flat[bucket.numel :].zero_()  # the padding
        if scale != 1.0:
            flat.mul_(scale)
        direct = self.master is None and not self.reduced and flat.dtype == self.values.dtype
        out = self._buffer() if direct else flat.new_empty(bucket.shard_size)
        if not direct:
            self._pending.append(out)
        return bucket.group.reduce_scatter_tensor(out, flat, ReduceOp.AVG, async_op=async_op)

    def reduction_done(self, used: list[bool]) -> None:
        """ZeRO-2, after the reduce-scatter finished: accumulate it, forget the full gradients."""
        buffer = self._buffer()
        for out in self._pending:
            if self.reduced:
                buffer.add_(out)
            else:
                buffer.copy_(out)
            self.reduced = True
        self._pending.clear()
        self.reduced = True
        for i in range(len(self.bucket.params)):
            self.has_grad[i] = self.has_grad[i] or used[i]
        for piece, tensor in zip(self.bucket.pieces, self.tensors):
            start = piece.shard_offset
            tensor.grad = buffer[start : start + piece.hi - piece.lo] if self.has_grad[piece.index] else None

    def drop_staged(self) -> None:
        """Forget the gradients staged by a backward that failed before its buckets were reduced."""
        self._staging = None

    def forget_grads(self) -> None:
        self.drop_staged()
        for tensor in self.tensors:
            tensor.grad = None
        self.has_grad = [False] * len(self.has_grad)
        self.reduced = False

    # parameters --------------------------------------------------------------------------------------------------
    def publish(self, async_op: bool) -> Work | None:
        """Write the updated range into the parameters and all-gather every rank's range, in place."""
        if self.master is not None:
            self.bucket.shard().copy_(self.master)
        group = self.bucket.group
        if group.size() == 1:
            return None
        return group.all_gather_into_tensor(self.bucket.flat, self.bucket.shard(), async_op=async_op)

    def state_bytes(self) -> int:
        return 0 if self.master is None else self.master.numel() * self.master.element_size()
