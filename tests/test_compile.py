"""torch.compile in rank threads: no rank silently falls back to eager past dynamo's recompile limit, and
compiled models (DDP, GPT blocks under TP, pipeline chunks) equal the single-thread eager model.

backend="aot_eager" (dynamo + AOTAutograd, no code generation) keeps these fast; inductor is the demo's
default (`--compile`) and compiles the same graphs.
"""

import contextvars
import copy
import threading
from dataclasses import replace

import pytest
import torch
import torch._dynamo  # before the launches: the launch raises its limits only when dynamo is loaded
from helpers.ddp_reference import (
    assert_same,
    batches,
    grads_of,
    mlp,
    mse,
    params_of,
    rank_slice,
    reference_run,
    sgd,
)
from helpers.gpt_reference import check_against, hybrid_step, reference

import threadpar
from threadpar.demo.cli import parse_args
from threadpar.errors import ConfigError
from threadpar.models.gpt import GPTConfig
from threadpar.parallel import DistributedDataParallel
from threadpar.testing import TEST_CONFIG, run_ranks

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)


def _recording_backend(ran: dict[int, bool], inner: str | None = None):
    """A dynamo backend that compiles with `inner` (None: runs the captured graph as it is) and notes which
    threads ran a compiled graph: a rank that runs eagerly (past the recompile limit, or because nothing
    was compiled) never calls it."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        compiled = gm.forward if inner is None else torch._dynamo.lookup_backend(inner)(gm, example_inputs)

        def run(*args):
            ran[threading.get_ident()] = True  # each thread writes its own key
            return compiled(*args)

        return run

    return backend


def _ran_compiled(ran: dict[int, bool]) -> bool:
    return ran.get(threading.get_ident(), False)


@pytest.mark.timeout(240)
def test_more_rank_threads_than_the_recompile_limit_all_run_compiled():
    # Each rank compiles its own variant of one function (another shape, static), as pipeline stages or
    # ranks that miss the cache together do: 10 variants, 2 more than dynamo's default limit of 8.
    ranks = torch._dynamo.config.recompile_limit + 2
    ran: dict[int, bool] = {}
    backend = _recording_backend(ran)
    torch._dynamo.reset()

    def body():
        layer = torch.nn.Linear(4, 4)
        compiled = torch.compile(layer, backend=backend, dynamic=False)
        with torch.no_grad():
            compiled(torch.ones(threadpar.get_rank() + 1, 4))
        return _ran_compiled(ran), torch._dynamo.config.recompile_limit

    results = run_ranks(body, ranks)
    assert [compiled for compiled, _ in results] == [True] * ranks, "a rank ran eagerly past the limit"
    assert all(limit == 8 * ranks for _, limit in results)
    assert torch._dynamo.config.recompile_limit == 8, "the calling thread keeps its own limit"


def test_rank_threads_start_in_a_copy_of_the_launching_threads_context():
    var = contextvars.ContextVar("threadpar_test_var", default="unset")
    token = var.set("from the caller")
    try:

        def body():
            seen = var.get()
            var.set(f"rank {threadpar.get_rank()}")  # this rank's copy only
            threadpar.barrier()
            return seen, var.get()

        results = run_ranks(body, 3)
    finally:
        var.reset(token)
    assert results == [("from the caller", f"rank {r}") for r in range(3)]


@pytest.mark.timeout(240)
def test_compiled_ddp_model_equals_the_single_thread_model():
    template, data = mlp(), batches(steps=2, rows=8, n_in=6, n_out=3)
    first_grads, final_params = reference_run(template, data, sgd)
    ran: dict[int, bool] = {}
    backend = _recording_backend(ran, "aot_eager")

    def body():
        rank = threadpar.get_rank()
        model = copy.deepcopy(template)
        # (torch.compile(module), not module.compile(): dynamo skips the frames of torch's own modules, so
        # an in-place compile of an nn.Sequential of torch layers would compile nothing.)
        ddp = DistributedDataParallel(torch.compile(model, backend=backend))
        optimizer = sgd(list(model.parameters()))
        grads = None
        for x, y in data:
            optimizer.zero_grad()
            mse(ddp, rank_slice(x, rank, 2), rank_slice(y, rank, 2)).backward()
            grads = grads or grads_of(model)
            optimizer.step()
        return _ran_compiled(ran), grads, params_of(model)

    for compiled, grads, params in run_ranks(body, 2):
        assert compiled, "the model ran eagerly"
        assert_same(grads, first_grads, "first-step gradient")
        assert_same(params, final_params, "parameter after 2 steps")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("dp", "tp", "pp"), [(1, 2, 1), (1, 1, 2)], ids=["tp", "pipeline"])
def test_compiled_gpt_blocks_equal_the_single_thread_model(dp, tp, pp):
    ref = reference(TINY, batch=4)
    ran: dict[int, bool] = {}
    backend = _recording_backend(ran, "aot_eager")

    def step():
        loss, grads = hybrid_step(ref, "1f1b", 2, compile=backend)
        return _ran_compiled(ran), loss, grads

    # Ranks compile one after another (dynamo's compile lock): their peers wait longer than usual.
    config = replace(TEST_CONFIG, timeout=180.0)
    results = run_ranks(step, dp * tp * pp, config=config, dp=dp, tp=tp, pp=pp)
    assert all(compiled for compiled, _, _ in results), "a rank ran its blocks eagerly"
    check_against(ref, [(loss, grads) for _, loss, grads in results])


def test_demo_compile_flag_names_a_backend():
    assert parse_args([]).compile is None
    assert parse_args(["--compile"]).compile == "inductor"
    assert parse_args(["--compile", "aot_eager"]).compile == "aot_eager"
    with pytest.raises(ConfigError, match=r"--compile .nope.: choose a torch\.compile backend"):
        parse_args(["--compile", "nope"])


@pytest.mark.timeout(240)
def test_compiled_code_that_calls_a_collective_breaks_its_graph_there():
    # dynamo must not trace the collective: with dynamic shapes it would meet the other ranks' tensors
    # as fake ones inside the rendezvous (TorchRuntimeError, before threadpar.comm was on its skip list).
    def body():
        group = threadpar.get_group()

        def f(x):
            y = x * 2
            group.all_reduce(y)
            return y + 1

        compiled = torch.compile(f, backend="aot_eager", dynamic=True)
        return [compiled(torch.full((n + 2, 3), float(threadpar.get_rank() + 1))) for n in range(3)]

    for outputs in run_ranks(body, 2):
        for n, out in enumerate(outputs):
            torch.testing.assert_close(out, torch.full((n + 2, 3), 2.0 * (1 + 2) + 1))
