"""The demo's --cuda-graphs on the double: the graphed run trains as the eager one does, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("capturable_on_cpu")]


@pytest.mark.parametrize(("zero", "sp"), [(0, True), (2, False)])
def test_the_demos_graphed_steps_train_as_its_eager_steps_do(zero, sp):
    from threadpar.demo.__main__ import prepare
    from threadpar.demo.cli import DemoConfig
    from threadpar.demo.train import train_rank

    def run(cuda_graphs: bool):
        cfg = DemoConfig(
            gpus=4, dp=2, tp=2, pp=1, steps=6, seq_len=16, batch_size=8, zero=zero, sequence_parallel=sp,
            cuda_graphs=cuda_graphs, out=None,
        )  # fmt: skip
        state = prepare(cfg)
        run_fake_gpus(lambda: train_rank(state), 4, FakeCuda(), dp=2, tp=2)
        return torch.tensor(state.losses), torch.tensor(state.grad_norms)

    graphed, eager = run(True), run(False)
    # (graphed, AdamW runs capturable: its arithmetic on tensors may differ in the last bits)
    torch.testing.assert_close(graphed, eager)


def test_the_demo_says_what_it_cannot_graph():
    from threadpar.demo.cli import DemoConfig

    with pytest.raises(
        threadpar.ConfigError, match=r"--cuda-graphs cannot graph this run: pp=2 .*pass --pp 1"
    ):
        DemoConfig(gpus=8, cuda_graphs=True)
    with pytest.raises(threadpar.ConfigError, match="--dtype fp16"):
        DemoConfig(gpus=2, pp=1, dtype="fp16", cuda_graphs=True)


def test_on_cpu_threads_the_demo_runs_its_graphed_step_eagerly(tmp_path, capsys):
    from threadpar.demo.__main__ import main

    argv = [
        "--gpus",
        "2",
        "--pp",
        "1",
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--cuda-graphs",
    ]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "CUDA graphs" in captured.out and "loss" in captured.out
