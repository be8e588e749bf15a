"""fp16/bf16 AVG without overflow (issue 37, item 6): where the mean is finite, so is the result, on both
backends, and they agree exactly (same pre-scaled sum, same order: comm/common/reduce_op.accumulate_ and the
nccl backend's ncclRedOpCreatePreMulSum, comm/nccl/reduction.py)."""

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from fakes.sim_gpu import to_host

import threadpar
from threadpar.comm.common.reduce_op import ReduceOp, accumulate_
from threadpar.comm.nccl.cuda_api import release_pooled
from threadpar.testing import run_ranks

pytestmark = pytest.mark.usefixtures("fake_mode")

# Near each type's largest finite value (fp16: 65504; bf16: 3.39e38), with the sign and the magnitude varied
# per rank and element so the mean is not one of the inputs.
LARGE = {torch.float16: 40000.0, torch.bfloat16: 2.5e38}


def _inputs(dtype: torch.dtype, rank: int) -> torch.Tensor:
    base = torch.tensor([1.0, 0.75, -1.0, 0.5, 0.999, -0.6], dtype=torch.float64) * LARGE[dtype]
    return (base * (1 - 0.01 * rank)).to(dtype)


def _expected(dtype: torch.dtype, world: int) -> torch.Tensor:
    """The exact mean (float64 of the dtype's inputs), rounded to the dtype."""
    return (sum(_inputs(dtype, r).double() for r in range(world)) / world).to(dtype)


def _collectives(dtype: torch.dtype):
    """This rank's all_reduce, reduce (root 1) and reduce_scatter_tensor AVG of its large inputs."""
    rank, world, dev = threadpar.get_rank(), threadpar.get_world_size(), threadpar.get_device()
    mine = _inputs(dtype, rank).to(dev)
    every = mine.clone()
    threadpar.all_reduce(every, op="AVG")
    root = mine.clone()
    threadpar.reduce(root, dst=1, op="AVG")
    stacked = torch.cat([mine] * world)
    part = torch.empty_like(mine)
    threadpar.reduce_scatter_tensor(part, stacked, op="AVG")
    return every, root, part


@pytest.mark.parametrize("world", [3, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_avg_of_large_half_precision_values_is_the_finite_mean_on_both_backends(dtype, world):
    def body():
        return _collectives(dtype)

    expected = _expected(dtype, world)
    assert torch.isfinite(expected).all() and not torch.isfinite(expected.double().mul(world).to(dtype)).all()
    threads = run_ranks(body, world)
    nccl = to_host(run_fake_gpus(body, world, FakeCuda()))
    # n roundings of the sum and one of the division, each half a unit in the last place of |mean|
    rtol = (world + 1) * torch.finfo(dtype).eps / 2
    for rank in range(world):
        results = zip(("all_reduce", "reduce", "reduce_scatter"), threads[rank], nccl[rank], strict=True)
        for name, got_threads, got_nccl in results:
            if name == "reduce" and rank != 1:
                continue  # (only the root's tensor holds the result)
            where = f"{name}, rank {rank}"
            torch.testing.assert_close(got_threads, expected, rtol=rtol, atol=0, msg=f"threads {where}")
            torch.testing.assert_close(got_nccl, expected, rtol=rtol, atol=0, msg=f"nccl {where}")
            if name != "reduce_scatter":  # (the threads backend's reduce_scatter starts from the member's own
                # chunk, the double sums in rank order: a rounding apart; all-reduce and reduce add alike)
                torch.testing.assert_close(
                    got_nccl, got_threads, rtol=0, atol=0, msg=f"nccl vs threads {where}"
                )


def test_avg_on_nccl_without_pre_multiplied_sums_still_sums_then_divides():
    # NCCL 2.10 has ncclAvg (biased for fp16 over 3 ranks) but no ncclRedOpCreatePreMulSum: SUM, then divide,
    # as before; moderate values so the sum stays finite, equal to the threads backend's within rounding.
    def body():
        t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16, device=threadpar.get_device()) * (
            1 + threadpar.get_rank()
        )
        threadpar.all_reduce(t, op="AVG")
        return t

    fake = FakeCuda((2, 10, 3))
    nccl = to_host(run_fake_gpus(body, 3, fake))
    assert {c.extra["op"] for c in fake.calls_named("all_reduce")} == {0}  # ncclSum
    for got in nccl:
        torch.testing.assert_close(got, torch.tensor([2.0, 4.0, 6.0], dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [2, 3, 4, 7, 8])
def test_accumulate_pre_scaled_equals_the_unscaled_sum_and_division_where_that_is_finite(dtype, count):
    # round(sum(x * 2^-m) / (n * 2^-m)) == round(sum(x) / n) in the normal range (scaling by a power of two
    # commutes with rounding there): the pre-scaling changes no result that did not overflow.
    g = torch.Generator().manual_seed(count)
    rows = [(torch.rand(4096, generator=g, dtype=torch.float64) * 8 - 4).to(dtype) for _ in range(count)]
    got = accumulate_(rows[0].clone(), rows[1:], ReduceOp.AVG, count)
    plain = rows[0].clone()
    for r in rows[1:]:
        plain.add_(r)
    if count == 2:  # (the two-member path is lerp: a + (b - a) / 2 in float, one rounding)
        plain = ((rows[0].float() + rows[1].float()) / 2).to(dtype)
    else:
        plain.div_(count)
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_each_communicator_makes_its_op_once_per_dtype_and_destroys_it_before_itself():
    # nccl.h: an op of ncclRedOpCreatePreMulSum is one communicator's and one datatype's; NcclComm makes it at
    # its first use and destroys it before ncclCommDestroy (comm.py).
    fake = FakeCuda()
    log: list[tuple[str, object, object]] = []
    nccl = fake.nccl
    create, destroy, comm_destroy = nccl.red_op_create_pre_mul_sum, nccl.red_op_destroy, nccl.comm_destroy

    def logged_create(scalar, dtype, comm):
        op = create(scalar, dtype, comm)
        log.append(("create", (comm.uid, comm.rank), (op, dtype, scalar)))
        return op

    def logged_destroy(op, comm):
        log.append(("destroy", (comm.uid, comm.rank), op))
        destroy(op, comm)

    def logged_comm_destroy(comm):
        log.append(("comm_destroy", (comm.uid, comm.rank), None))
        comm_destroy(comm)

    nccl.red_op_create_pre_mul_sum, nccl.red_op_destroy = logged_create, logged_destroy
    nccl.comm_destroy = logged_comm_destroy

    def body():
        for dtype in (torch.float16, torch.float16, torch.bfloat16, torch.float16):
            t = torch.ones(4, dtype=dtype, device=threadpar.get_device())
            threadpar.all_reduce(t, op="AVG")
        return t

    for got in to_host(run_fake_gpus(body, 3, fake)):
        torch.testing.assert_close(got, torch.ones(4, dtype=torch.float16))
    # the launch's end pools the communicators; the process's exit destroys them
    assert release_pooled(fake.cliques) == 3
    comms = {key for what, key, _ in log if what == "comm_destroy"}
    assert len(comms) == 3 and not nccl.violations
    for key in comms:
        mine = [(what, detail) for what, k, detail in log if k == key]
        made = [detail for what, detail in mine if what == "create"]
        assert sorted((str(dtype), scalar) for _, dtype, scalar in made) == [
            ("torch.bfloat16", 0.25),
            ("torch.float16", 0.25),
        ]
        destroyed = [detail for what, detail in mine[:-1] if what == "destroy"]
        assert sorted(destroyed) == sorted(op for op, _, _ in made) and mine[-1][0] == "comm_destroy"
