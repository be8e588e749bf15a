"""`ProcessGroup`: one rank's handle on a group, with torch.distributed's collectives as methods.

Capture the handle when you build an autograd Function or hook: it works from any thread, whereas the
rank's thread-local context does not exist on PyTorch's backward threads.

`src`/`dst` arguments are global ranks, as in torch.distributed. Validation happens here, before the
rendezvous, so a bad argument raises on the rank that passed it, with a message that says how to fix it.
Point-to-point methods come from PointToPoint; identity, checks and dispatch from GroupHandle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from threadpar.comm.common.reduce_op import ReduceOp, check_reducible
from threadpar.comm.common.rendezvous import Call
from threadpar.comm.common.work import Work
from threadpar.comm.handle import GroupState, _contiguous, _write_back, spec
from threadpar.comm.point_to_point import PointToPoint
from threadpar.errors import ConfigError

__all__ = ["GroupState", "ProcessGroup", "spec"]


class ProcessGroup(PointToPoint):
    def all_reduce(
        self, tensor: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        return self.all_reduce_coalesced((tensor,), op, async_op, _name="all_reduce")

    def all_reduce_coalesced(
        self,
        tensors: Sequence[torch.Tensor],
        op: object = ReduceOp.SUM,
        async_op: bool = False,
        *,
        _name: str = "all_reduce_coalesced",
    ) -> Work | None:
        """All-reduce a list of tensors of one dtype in one collective (one meeting for all of them)."""
        # This is the hottest path of small-message latency: checks are kept to plain Python.
        if type(op) is not ReduceOp:
            op = ReduceOp.parse(op)
        if not tensors:
            raise ConfigError(f"{_name}: got an empty list of tensors")
        for t in tensors:
            self._check_tensor(_name, "tensor", t)
        dtype = tensors[0].dtype
        if len(tensors) > 1 and any(t.dtype != dtype for t in tensors):
            raise ConfigError(
                f"{_name}: all tensors must share one dtype, got {sorted({str(t.dtype) for t in tensors})}"
            )
        check_reducible(dtype, op)
        seq = self._next(_name)
        shape = tensors[0].shape if len(tensors) == 1 else (sum(t.numel() for t in tensors),)
        call = Call(_name, dtype, shape, op.extra)
        member, backend = self._member, self._backend
        # A stream-ordered backend returns its Work; otherwise the Work's result is the tensors, as in torch
        # (work.get_future().value()[0] is tensors[0]). The list is made here, on the issuing thread: made on
        # the comm worker and released last by this thread, free-threaded CPython would free it (and keep
        # the tensors) only once the idle worker runs again (DESIGN.md rule 10, biased reference counting).
        issued = list(tensors)

        def run() -> Any:
            staged = [_contiguous(t) for t in tensors]
            result = backend.all_reduce(member, seq, call, [c for c, _ in staged], op, async_op)
            _write_back(result, [writeback for _, writeback in staged])
            return issued if result is None else result

        return self._run(_name, seq, run, async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        op = ReduceOp.parse(op)
        self._check_tensor("reduce", "tensor", tensor)
        check_reducible(tensor.dtype, op)
        dst_m = self._to_member(dst, "dst")
        seq = self._next("reduce")
        call = Call("reduce", tensor.dtype, tuple(tensor.shape), (("dst", dst), ("op", op.value)))
        member, backend = self._member, self._backend

        def run() -> Any:
            flat, writeback = _contiguous(tensor)
            result = backend.reduce(member, seq, call, flat, dst_m, op, async_op)
            _write_back(result, [writeback if member == dst_m else None])
            return result

        return self._run("reduce", seq, run, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        self._check_tensor("broadcast", "tensor", tensor)
        src_m = self._to_member(src, "src")
        seq = self._next("broadcast")
        call = Call("broadcast", tensor.dtype, tuple(tensor.shape), (("src", src),))
        member, backend = self._member, self._backend

        def run() -> Any:
            staged, writeback = _contiguous(tensor)
            result = backend.broadcast(member, seq, call, staged, src_m, async_op)
            _write_back(result, [writeback if member != src_m else None])
            return result

        return self._run("broadcast", seq, run, async_op)

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        self._check_tensor("all_gather", "tensor", tensor)
        outputs = self._check_list("all_gather", "tensor_list", tensor_list, tensor)
        seq = self._next("all_gather")
        call = Call("all_gather", tensor.dtype, tuple(tensor.shape))
        member, backend = self._member, self._backend
        return self._run(
            "all_gather",
            seq,
            lambda: backend.all_gather(member, seq, call, outputs, tensor, async_op),
            async_op,
        )

    def all_gather_into_tensor(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """output is the members' inputs concatenated along dim 0 (or stacked: shape [size, *input.shape])."""
        op = "all_gather_into_tensor"
        self._check_tensor(op, "input_tensor", input_tensor)
        self._check_tensor(op, "output_tensor", output_tensor)
        self._check_contiguous(op, "output_tensor", output_tensor)
        if (
            output_tensor.dtype != input_tensor.dtype
            or output_tensor.numel() != self.size() * input_tensor.numel()
        ):
            raise ConfigError(
                f"{op}: output_tensor is {spec(output_tensor)} but must hold {self.size()} x "
                f"{spec(input_tensor)} ({self.size() * input_tensor.numel()} elements)"
            )
        outputs = list(output_tensor.view(self.size(), *input_tensor.shape).unbind(0))
        seq = self._next(op)
        call = Call(op, input_tensor.dtype, tuple(input_tensor.shape))
        member, backend = self._member, self._backend
        return self._run(
            op,
            seq,
            lambda: backend.all_gather(member, seq, call, outputs, input_tensor, async_op),
            async_op,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: object = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        op = ReduceOp.parse(op)
        self._check_tensor("reduce_scatter", "output", output)
        check_reducible(output.dtype, op)
        inputs = self._check_list("reduce_scatter", "input_list", input_list, output)
        seq = self._next("reduce_scatter")
        call = Call("reduce_scatter", output.dtype, tuple(output.shape), (("op", op.value),))
        member, backend = self._member, self._backend
        return self._run(
            "reduce_scatter",
            seq,
            lambda: backend.reduce_scatter(member, seq, call, output, inputs, op, async_op),
            async_op,
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """output = this member's 1/size of the reduction of `input` along dim 0."""
        name = "reduce_scatter_tensor"
        op = ReduceOp.parse(op)
        self._check_tensor(name, "output", output)
        self._check_tensor(name, "input", input)
        check_reducible(output.dtype, op)
        self._check_contiguous(name, "input", input)
        if input.dtype != output.dtype or input.numel() != self.size() * output.numel():
            raise ConfigError(
                f"{name}: input is {spec(input)} but must hold {self.size()} x "
                f"{spec(output)} ({self.size() * output.numel()} elements)"
            )
        inputs = list(input.view(self.size(), *output.shape).unbind(0))
        seq = self._next(name)
        call = Call(name, output.dtype, tuple(output.shape), (("op", op.value),))
        member, backend = self._member, self._backend
        return self._run(
            name,
            seq,
            lambda: backend.reduce_scatter(member, seq, call, output, inputs, op, async_op),
            async_op,
        )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        self._check_tensor("scatter", "tensor", tensor)
        src_m = self._to_member(src, "src")
        if self._member == src_m:
            chunks = self._check_list("scatter", "scatter_list", scatter_list, tensor)
        elif scatter_list:
            raise ConfigError(
                f"scatter: only the source rank {src} passes scatter_list; rank {self.global_rank} passed one"
            )
        else:
            chunks = None
        seq = self._next("scatter")
        call = Call("scatter", tensor.dtype, tuple(tensor.shape), (("src", src),))
        member, backend = self._member, self._backend
        return self._run(
            "scatter",
            seq,
            lambda: backend.scatter(member, seq, call, tensor, chunks, src_m, async_op),
            async_op,
        )

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        async_op: bool = False,
    ) -> Work | None:
        self._check_tensor("gather", "tensor", tensor)
        dst_m = self._to_member(dst, "dst")
        if self._member == dst_m:
            outputs = self._check_list("gather", "gather_list", gather_list, tensor)
        elif gather_list:
            raise ConfigError(
                f"gather: only the destination rank {dst} passes gather_list; rank {self.global_rank} passed one"
            )
        else:
            outputs = None
        seq = self._next("gather")
        call = Call("gather", tensor.dtype, tuple(tensor.shape), (("dst", dst),))
        member, backend = self._member, self._backend
        return self._run(
            "gather",
            seq,
            lambda: backend.gather(member, seq, call, tensor, outputs, dst_m, async_op),
            async_op,
        )

    def all_to_all(
        self,
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        async_op: bool = False,
    ) -> Work | None:
        """output_tensor_list[i] receives input_tensor_list[this rank's index] of member i."""
        if not input_tensor_list:
            raise ConfigError("all_to_all: input_tensor_list is empty")
        first = self._check_tensor("all_to_all", "input_tensor_list[0]", input_tensor_list[0])
        inputs = self._check_list(
            "all_to_all", "input_tensor_list", input_tensor_list, first, same_shape=False
        )
        outputs = self._check_list(
            "all_to_all", "output_tensor_list", output_tensor_list, first, same_shape=False
        )
        seq = self._next("all_to_all")
        call = Call("all_to_all", first.dtype)
        member, backend = self._member, self._backend
        return self._run(
            "all_to_all",
            seq,
            lambda: backend.all_to_all(member, seq, call, outputs, inputs, async_op),
            async_op,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | torch.Tensor | None = None,
        input_split_sizes: Sequence[int] | torch.Tensor | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Split `input` along dim 0 (evenly, or by input_split_sizes) and exchange, as torch does. Split
        sizes may be lists or 1-D integer tensors (torch's threaded process group and gloo take both; a
        CUDA tensor of sizes costs a host sync to read, as in torch)."""
        name = "all_to_all_single"
        self._check_tensor(name, "input", input)
        self._check_tensor(name, "output", output)
        if input.dtype != output.dtype:
            raise ConfigError(f"{name}: output is {output.dtype} but input is {input.dtype}")
        inputs = self._split(name, "input", input, input_split_sizes)
        outputs = self._split(name, "output", output, output_split_sizes)
        seq = self._next(name)
        call = Call(name, input.dtype)
        member, backend = self._member, self._backend
        return self._run(
            name,
            seq,
            lambda: backend.all_to_all(member, seq, call, outputs, inputs, async_op),
            async_op,
        )

    def permute(
        self,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        src_dst: Sequence[int],
        async_op: bool = False,
    ) -> Work | None:
        """Member m sends `inputs` to member src_dst[m] and receives `outputs` from the member that sends to
        it: torch's permute_tensor (torch/distributed/_functional_collectives.py: src_dst[m] == n means m
        sends to n, group ranks) for several tensors at once, into given outputs. A collective: every member
        calls it in order with the same src_dst, and outputs[i] has the shape and dtype of inputs[i] on every
        member. On nccl it is one group of ncclSend/ncclRecv on the group's own communicator (a ring's shift,
        as ring attention does it: no host meeting, no copy, no communicator of its own)."""
        name = "permute"
        size = self.size()
        if sorted(src_dst) != list(range(size)):
            raise ConfigError(
                f"{name}: src_dst must be a permutation of the group ranks 0..{size - 1} (src_dst[m] is where "
                f"member m sends), got {list(src_dst)}"
            )
        if not inputs or len(inputs) != len(outputs):
            raise ConfigError(
                f"{name}: inputs and outputs must be lists of the same non-zero length, got {len(inputs)} and "
                f"{len(outputs)}"
            )
        for i, (x, y) in enumerate(zip(inputs, outputs)):
            self._check_tensor(name, f"inputs[{i}]", x)
            self._check_tensor(name, f"outputs[{i}]", y)
            if x.shape != y.shape or x.dtype != y.dtype:
                raise ConfigError(
                    f"{name}: outputs[{i}] is {spec(y)} but inputs[{i}] is {spec(x)}; every member sends and "
                    "receives the same shapes, so each output must match its input"
                )
        seq = self._next(name)
        call = Call(
            name, inputs[0].dtype, tuple(inputs[0].shape),
            (("src_dst", tuple(src_dst)), ("tensors", tuple(spec(t) for t in inputs))),
        )  # fmt: skip
        member, backend, targets = self._member, self._backend, list(src_dst)
        return self._run(
            name,
            seq,
            lambda: backend.permute(member, seq, call, list(inputs), list(outputs), targets, async_op),
            async_op,
        )

    def _split(
        self, op: str, what: str, t: torch.Tensor, sizes: Sequence[int] | torch.Tensor | None
    ) -> list[torch.Tensor]:
        n = t.shape[0] if t.dim() else 0
        if isinstance(sizes, torch.Tensor):
            sizes = [int(s) for s in sizes.tolist()]
        if sizes is None or len(sizes) == 0:
            if n % self.size():
                raise ConfigError(
                    f"{op}: {what} has {n} rows, not divisible by the group size {self.size()}; pass {what}_split_sizes"
                )
            sizes = [n // self.size()] * self.size()
        if len(sizes) != self.size() or sum(sizes) != n or any(s < 0 for s in sizes):
            raise ConfigError(
                f"{op}: {what}_split_sizes={list(sizes)} must have {self.size()} non-negative entries summing to {n}"
            )
        return list(torch.split(t, list(sizes), dim=0))

    def barrier(self, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """`timeout` (seconds): how long each member waits for the others, instead of the group's; the
        error names the ranks that did not arrive."""
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ConfigError(f"barrier: timeout must be a positive number of seconds, got {timeout!r}")
        seq = self._next("barrier")
        call = Call("barrier")
        member, backend = self._member, self._backend
        return self._run(
            "barrier", seq, lambda: backend.barrier(member, seq, call, timeout, async_op), async_op
        )
