"""The public API: threadpar.parallel lists its names explicitly, internals stay in their modules, and the
sub-packages' __all__ agree with what they import."""

import importlib

import pytest
from torch import nn

import threadpar
import threadpar.parallel as parallel
import threadpar.testing
from threadpar.parallel.tensor_parallel.parallelize import STYLES

SUBPACKAGES = ("clip_grad", "context_parallel", "ddp", "expert_parallel", "tensor_parallel", "zero")
# Internals of one module: importable from it, in no package's __all__.
INTERNALS = {
    "threadpar.parallel.tensor_parallel.random": ("INIT", "REPLICATED", "TP_REGION", "dropout"),
    "threadpar.parallel.expert_parallel.routing": ("assign",),
}
# The machinery a sub-package offers to the library's own layers (checkpoint, models, demo), not to a model.
SUBPACKAGE_ONLY = {
    "threadpar.parallel.tensor_parallel": ("ShardSpec", "TensorParallelModule", "padded_size", "RNGTracker"),
    "threadpar.parallel.expert_parallel": (
        "Routing",
        "expert_capacity",
        "AllToAllDispatcher",
        "GroupedExperts",
    ),
    "threadpar.parallel.context_parallel": ("load_balanced_chunks", "padding_multiple"),
}


def test_every_listed_name_exists_once_and_nothing_else_is_star_exported():
    names = parallel.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(parallel, name) is not None, name
    namespace: dict = {}
    exec("from threadpar.parallel import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(names)


@pytest.mark.parametrize("module", sorted({**INTERNALS, **SUBPACKAGE_ONLY}))
def test_internals_stay_importable_from_their_modules_but_are_not_the_api(module):
    for name in {**INTERNALS, **SUBPACKAGE_ONLY}[module]:
        assert hasattr(importlib.import_module(module), name)
        assert name not in parallel.__all__ and not hasattr(parallel, name), name


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_each_subpackage_all_names_what_it_provides(name):
    package = importlib.import_module(f"threadpar.parallel.{name}")
    assert len(package.__all__) == len(set(package.__all__))
    assert all(hasattr(package, n) for n in package.__all__)
    internal = {n for names in INTERNALS.values() for n in names}
    assert not internal & set(package.__all__)


def test_what_threadpar_parallel_exports_comes_from_a_subpackage_or_a_module_of_its_own():
    from_subpackages = {
        n for s in SUBPACKAGES for n in importlib.import_module(f"threadpar.parallel.{s}").__all__
    }
    own_modules = {"DataParallel", "LossScaler"}  # threadpar.parallel.data_parallel, .loss_scaler
    assert set(parallel.__all__) - from_subpackages == own_modules


def test_the_dropout_plan_entry_and_the_dropout_module_cannot_be_confused():
    assert not issubclass(
        parallel.DropoutParallel, nn.Module
    )  # a parallelize_plan entry: what to do with nn.Dropout
    assert issubclass(parallel.TrackedDropout, nn.Module)  # the module it installs
    assert isinstance(STYLES["dropout"](), parallel.DropoutParallel)
    assert STYLES["tp_dropout"]().in_tp_region
    assert not hasattr(parallel, "ParallelDropout")


def test_the_launch_config_is_part_of_the_top_level_api():
    assert "LaunchConfig" in threadpar.__all__ and threadpar.LaunchConfig is threadpar.runtime.LaunchConfig


def test_is_available_says_threadpar_runs_here_as_torch_distributed_is_available_does():
    # A script written for torch.distributed calls dist.is_available() first; threadpar always can run (CPU
    # threads without GPUs), inside a rank or not.
    assert threadpar.is_available() is True and "is_available" in threadpar.__all__
    assert threadpar.testing.run_ranks(threadpar.is_available, 2) == [True, True]
