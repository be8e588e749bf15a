"""DistributedDataParallel on the nccl backend, over the CUDA/NCCL test double (its device tensors): its Works are
stream-ordered, so the reducer must wait on them rather than on futures that only the host completes."""

import copy

import pytest
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus
from helpers.ddp_reference import adam, assert_same, batches, ddp_run, mlp, reference_run

import threadpar
from threadpar import ConfigError
from threadpar.parallel import DistributedDataParallel
from threadpar.parallel.ddp import comm_hooks

# Each test runs with the double running NCCL operations once issued and lazily (conftest.fake_mode).
pytestmark = pytest.mark.usefixtures("fake_mode")


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("device_thread", [False, True], ids=["rank-thread", "device-thread"])
def test_matches_single_thread_on_the_nccl_backend(view, device_thread):
    """device_thread: backward (the reducer's hooks and end-of-backward callback) runs on a thread of its own
    without the rank's context, as CUDA's autograd engine runs it (fakes/fake_autograd_thread.py)."""
    template = mlp()
    data = batches(steps=3, rows=8, n_in=6, n_out=3)
    expected_grads, expected_params = reference_run(template, data, adam)
    results = ddp_run(
        template,
        data,
        adam,
        2,
        runner=lambda body, world: run_fake_gpus(body, world, FakeCuda(autograd_thread=device_thread)),
        bucket_cap_mb=0,
        first_bucket_cap_mb=0,
        gradient_as_bucket_view=view,
    )
    for grads, params in results:
        assert_same(grads, expected_grads, "gradient")
        assert_same(params, expected_params, "parameter")


def test_comm_hooks_are_refused_on_stream_ordered_groups():
    def body():
        ddp = DistributedDataParallel(copy.deepcopy(mlp()).to(threadpar.get_device()))
        with pytest.raises(ConfigError, match="not supported on group"):
            ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)

    run_fake_gpus(body, 2, FakeCuda())
