"""LaunchConfig: validated when built, passed through a launch as one object, and kept apart from the
keyword arguments of the function the ranks run."""

import dataclasses
import importlib

import pytest
import torch

import threadpar
from threadpar import ConfigError, LaunchConfig
from threadpar.runtime import current
from threadpar.testing import TEST_CONFIG, launch_processes, run_ranks

# (threadpar.runtime.launch is also the name of the function that package exports)
launch_module = importlib.import_module("threadpar.runtime.launch")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(world_size=0), "world_size must be a positive int, got 0 \\(or leave world_size out"),
        (dict(tp=0), "tp must be a positive int, got 0 \\(tp=1: no tensor parallelism\\)"),
        (dict(pp=True), "pp must be a positive int, got True"),
        (
            dict(dp=-2),
            "dp must be a positive int, got -2 \\(or leave dp out: world_size / \\(tp\\*cp\\*pp\\)\\)",
        ),
        (dict(backend="gloo"), "backend='gloo' is not one of \\('auto', 'threads', 'nccl'\\)"),
        (dict(timeout=0), "timeout must be a positive number of seconds, got 0"),
        (dict(seed=1.5), "seed must be an int, got 1.5"),
        (dict(order="PP-XX"), "unknown axis 'XX'; use one of"),
        (dict(order="TP-TP"), "names an axis twice"),
        (dict(devices="gpu"), "devices must be an int .* or 'cpu'; got 'gpu'"),
        (dict(devices=[]), "a non-empty list of CUDA device ids"),
        (dict(intraop_threads=0), "intraop_threads must be a positive int"),
        (dict(print_layout="yes"), "print_layout must be True or False"),
        (dict(check_collectives=1), "check_collectives must be True or False"),
        (dict(threads_per_process=0), "threads_per_process must be a positive int"),
        (dict(world_size=6, tp=4), "world size 6 is not divisible by tp\\*cp\\*pp = 4 .* or run 4 ranks"),
        (dict(world_size=8, dp=3, tp=2), "= 6 but there are 8 ranks; make the product equal 8"),
    ],
)
def test_a_bad_option_is_explained_when_the_config_is_built(options, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(**options)


def test_the_config_is_frozen_keyword_only_and_holds_devices_immutably():
    config = LaunchConfig(world_size=2, devices=[0, 1])
    assert config.devices == (
        0,
        1,
    )  # a list given becomes a tuple: the frozen config cannot change under a launch
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tp = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        LaunchConfig(2)  # type: ignore[misc]
    assert config.with_options({"tp": 2}).tp == 2 and config.tp == 1


def test_one_config_object_reaches_the_world_and_the_ranks(monkeypatch):
    seen = []
    build = launch_module._one_process_world
    monkeypatch.setattr(launch_module, "_one_process_world", lambda cfg, t: seen.append(cfg) or build(cfg, t))
    config = dataclasses.replace(TEST_CONFIG, world_size=4, tp=2, seed=11, order="PP-CP-TP-DP")

    def body():
        world, layout = current().world, threadpar.get_layout()
        return world.seed, world.timeout, (layout.dp, layout.tp), layout.order[-1].value

    assert threadpar.launch(body, config=config) == [(11, TEST_CONFIG.timeout, (2, 2), "DP")] * 4
    assert seen == [config] and seen[0] is config  # passed through, not re-assembled from its fields


def test_keywords_replace_the_fields_of_a_config():
    def body():
        return current().world.seed, threadpar.get_world_size()

    config = dataclasses.replace(TEST_CONFIG, world_size=4, seed=1)
    assert threadpar.launch(body, config=config, seed=5, world_size=2) == [(5, 2), (5, 2)]


def test_a_function_keyword_named_like_an_option_reaches_the_function_through_kwargs():
    def body(*, seed, timeout, world_size):
        return seed, timeout, world_size, current().world.seed, threadpar.get_world_size()

    kwargs = {"seed": 7, "timeout": 1.5, "world_size": "mine"}
    results = run_ranks(body, 2, kwargs=kwargs, seed=3)
    assert results == [(7, 1.5, "mine", 3, 2)] * 2  # the function's values; the launch's own seed and size


def test_an_unknown_keyword_is_an_error_that_says_to_use_kwargs_before_any_rank_runs():
    ran = []
    with pytest.raises(ConfigError) as caught:
        threadpar.launch(ran.append, 1, world_size=2, devices="cpu", plan="mine", world_szie=2)
    message = str(caught.value)
    assert "unknown option(s) 'plan', 'world_szie' (did you mean 'world_size'?)" in message
    assert "The launch options are: world_size, devices, dp, tp, pp, cp, ep, backend, timeout" in message
    assert "Pass the function's own keyword arguments as kwargs={...}" in message
    assert ran == []


def test_bad_config_and_kwargs_arguments_are_explained():
    with pytest.raises(ConfigError, match="config must be a threadpar\\.LaunchConfig, got dict"):
        threadpar.launch(lambda: None, config={"world_size": 2})
    with pytest.raises(ConfigError, match="kwargs= holds the function's keyword arguments as a dict"):
        threadpar.launch(lambda: None, kwargs=[("a", 1)], world_size=2, devices="cpu")


def test_simulated_processes_take_the_same_options_and_reject_unknown_ones():
    def body(scale):
        return torch.get_num_threads() * scale

    outcomes = launch_processes(
        body, 2, 1, per_process=lambda p: {"intraop_threads": p + 1}, kwargs={"scale": 10}
    )
    assert outcomes == [[10], [20]]
    with pytest.raises(ConfigError, match="unknown option\\(s\\) 'scale'"):
        launch_processes(body, 2, 1, scale=10)
    bad = launch_processes(body, 2, 1, kwargs={"scale": 1}, per_process=lambda p: {"sead": p})
    assert all(isinstance(o, ConfigError) and "did you mean 'seed'" in str(o) for o in bad)


def test_the_test_defaults_are_a_launch_config():
    assert TEST_CONFIG.devices == "cpu" and TEST_CONFIG.backend == "threads"
    assert run_ranks(lambda: torch.get_num_threads() >= 1, 2) == [True, True]
