"""The recipe scripts in demos/ run, learn, and (TP) match the dense model."""

import importlib.util
from pathlib import Path

import pytest

DEMOS = Path(__file__).parent.parent / "demos"


def load(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", DEMOS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "steps"), [("ddp_only", 60), ("pp_only", 12), ("hybrid_3d", 8)])
def test_recipe_learns(name, steps):
    losses = load(name).main(steps=steps)
    assert losses[-1] < losses[0]


def test_tp_recipe_equals_the_dense_model():
    tp_loss, dense_loss = load("tp_only").main(steps=10)
    assert tp_loss == pytest.approx(dense_loss, rel=1e-4)


def test_the_committed_notebook_is_what_make_notebook_writes():
    import nbformat

    committed = nbformat.read(DEMOS / "train_gpt.ipynb", as_version=4)
    built = load("make_notebook").build()
    assert [c.source for c in committed.cells] == [c.source for c in built.cells]
