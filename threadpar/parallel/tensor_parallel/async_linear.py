"""A column-parallel linear whose backward overlaps the input-gradient collective with the weight-gradient GEMM.

    Y = X W^T + b,  W: [out / tp, in] (this rank's rows),  X: [..., in] (whole, or this rank's sequence shard)

The input gradient dX = dY W is partial on each rank (each holds only its rows of W) and must be summed over
the TP group: an all-reduce, or under sequence parallelism a reduce-scatter back to the sequence shards.
The weight gradient dW = dY^T X does not depend on it. So backward, as Megatron's
LinearWithGradAccumulationAndAsyncCommunication does, computes dX first, launches its collective with
async_op=True, computes dW while the collective runs, and waits only before returning:

    plain:     dX = dY W  ->  launch all-reduce(dX)  ->  dW = dY^T X, db  ->  wait
    sequence:  launch all-gather(X shard)  ->  dX = dY W  ->  wait gather  ->  launch reduce-scatter(dX)
               ->  dW = dY^T X_total, db  ->  wait

Under sequence parallelism forward keeps only this rank's shard of X for backward (1/tp of the gathered
input's memory) and backward gathers it again, overlapped with the dX GEMM: one more all-gather per layer
and step, in exchange for the activation memory, as in Megatron.

On the threads backend an async op runs on the rank's comm worker thread (overlap needs a free core); on
nccl it runs on the group's comm stream and `wait()` only orders the compute stream after it, so the dW
GEMM on the compute stream runs while NCCL moves the data. The group is the handle the layer captured
when it was built: backward may run on a thread with no rank context (torch's device threads on CUDA).

Under autocast the GEMMs run in the autocast dtype, as F.linear's would; the collectives move dX in the
input's dtype, as the non-overlapped path (the mappings, then F.linear) does, so both give equal results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from threadpar.comm.group import ProcessGroup
from threadpar.errors import ConfigError
from threadpar.parallel.tensor_parallel.collectives import (
    Pending,
    all_gather_along_dim,
    start_all_gather_along_dim,
    start_all_reduce_,
    start_reduce_scatter_along_dim,
)
from threadpar.runtime.context import current

SEQ = "the sequence length"


def resolve_overlap(overlap: bool | None, group: ProcessGroup) -> bool:
    """`overlap_grad_comm` as given, or for None where it helps (call on the rank thread). On nccl the
    collective runs on the comm stream, beside the compute stream: on. On the threads backend it runs on
    the rank's comm worker thread, which needs a core the ranks' GEMMs leave free: on when this process has
    more cores than rank threads x intra-op threads. With launch's default intra-op threads (the cores
    divided among the ranks) that is off: both cores of a 2-core machine with 2 ranks are busy with GEMMs,
    and a worker preempting an intra-op thread would stall the GEMM's other threads (benchmarks/tp.py
    times both paths). Both paths give bit-identical results, so the choice never changes numerics."""
    if overlap is not None:
        if not isinstance(overlap, bool):
            raise ConfigError(f"overlap_grad_comm must be True, False or None (auto), got {overlap!r}")
        return overlap
    if group.stream_ordered:
        return True
    from threadpar.runtime.launch import available_cores  # looked up per call: tests patch it

    world = current().world
    return available_cores() > world.threads_per_process * world.intraop_threads


def _needed(ctx, index: int) -> bool:
    """Whether this backward pass needs the gradient of tensor input `index` (x 0, weight 1, bias 2).

    `ctx.needs_input_grad` is fixed at forward time, but `torch.autograd.grad(..., inputs=)` may want
    only some of them: the B and W halves of a zero-bubble schedule ask for the input gradient and the
    weight gradients separately. Without this each half would redo the other's GEMM, and B's dX
    collective would run again in W. The engine knows whether it will run the node a gradient flows
    into (`torch._C._will_engine_execute_node`, which torch.autograd.graph.register_multi_grad_hook
    uses); it refuses to answer for a leaf that torch.autograd.grad captures, which it raises only when
    that leaf will run, so that error means "needed"."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch/csrc/autograd/init.cpp: a captured leaf that will execute
        return True


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    if t is None or dtype is None or not t.is_floating_point():
        return t
    return t.to(dtype)


class _LinearWithAsyncGradComm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_dim):
        # x: [..., in] replicated (sequence_dim None), or this rank's shard along sequence_dim; -> [..., out/tp]
        ctx.group, ctx.dim = group, sequence_dim
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        device_type = x.device.type
        low = _autocast_dtype(device_type)  # cast as F.linear under autocast would
        x, weight, bias = _cast(x, low), _cast(weight, low), _cast(bias, low)
        with torch.autocast(device_type, enabled=False):
            total = x if sequence_dim is None else all_gather_along_dim(x, sequence_dim, group)
            out = F.linear(total, weight, bias)
        ctx.save_for_backward(x, weight)  # x: the local shard under SP, gathered again in backward
        return out

    @staticmethod
    @once_differentiable  # the collectives are not differentiable: a double backward raises, not lies
    def backward(ctx, grad_out):
        # grad_out: [..., out/tp] over the whole sequence
        x, weight = ctx.saved_tensors
        group, dim = ctx.group, ctx.dim
        need_x, need_w, need_b = (_needed(ctx, i) for i in range(3))
        gathering: Pending | None = None
        if need_w and dim is not None:
            gathering = start_all_gather_along_dim(x, dim, group)  # runs during the dX GEMM
        grad_total = None
        if need_x:
            # [..., in]: this rank's partial sum of the gradient of the whole input, in the input's dtype
            # (the non-overlapped path reduces it there too)
            grad_total = grad_out.matmul(weight).to(ctx.x_dtype)
        total = x if gathering is None else gathering.wait()
        reducing: Pending | None = None
        if grad_total is not None:
            if dim is None:
                reducing = start_all_reduce_(grad_total, group)
            else:
                reducing = start_reduce_scatter_along_dim(grad_total, dim, group, SEQ)
        # While the collective runs: dW [out/tp, in] = dY^T X over every token, db [out/tp].
        grad_w = grad_b = None
        if need_w:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().mm(total.reshape(-1, total.shape[-1]))
            grad_w = grad_w.to(ctx.weight_dtype)
        if need_b:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        grad_x = None if reducing is None else reducing.wait()
        return grad_x, grad_w, grad_b, None, None


def linear_with_async_grad_comm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup,
    *,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) on this rank's rows of a column-parallel weight, entering the TP region:
    x is replicated (its gradient is all-reduced) or, with `sequence_dim`, this rank's sequence shard
    (gathered first; its gradient reduce-scattered). Backward overlaps that collective with the weight
    gradient. `group`: a captured handle (call this on the rank thread)."""
    if group.size() == 1:
        return F.linear(x, weight, bias)
    return _LinearWithAsyncGradComm.apply(x, weight, bias, group, sequence_dim)
