"""The demo's --cuda-graphs on the double: the graphed run trains as the eager one does, and what it refuses."""

from __future__ import annotations

import math

import pytest
import torch
from fakes.fake_cuda_nccl import FakeCuda, run_fake_gpus

import threadpar

pytestmark = [pytest.mark.timeout(120)]


LAYOUTS = {  # name -> DemoConfig's layout options (4 ranks)
    "dp2 x tp2, SP": {"dp": 2, "tp": 2, "pp": 1, "sequence_parallel": True},
    "dp2 x tp2, ZeRO-2": {"dp": 2, "tp": 2, "pp": 1, "zero": 2},
    "pp2 x dp2, 1F1B": {"dp": 2, "tp": 1, "pp": 2, "schedule": "1f1b"},
    "pp2 x tp2, interleaved": {"dp": 1, "tp": 2, "pp": 2, "schedule": "interleaved"},
    "cp2 x dp2 (ring attention)": {"dp": 2, "tp": 1, "pp": 1, "cp": 2},
    "dp2 x tp2, MoE ep2 (padded to capacity)": {
        "dp": 2, "tp": 2, "pp": 1, "moe_experts": 4, "ep": 2, "moe_capacity_factor": 1.25,
    },
    "pp2 x dp2, MoE ep2, fp16": {
        "dp": 2, "tp": 1, "pp": 2, "moe_experts": 4, "ep": 2, "moe_capacity_factor": 1.0, "dtype": "fp16",
    },
}  # fmt: skip


def run_demo(layout: dict, cuda_graphs: bool, monkeypatch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo on 4 ranks of the double, 6 steps: (losses, gradient norms; NaN for a skipped step). With
    `monkeypatch`, --cuda-graphs' device step runs eagerly (graphed_step made the identity)."""
    from threadpar.demo import train
    from threadpar.demo.__main__ import prepare
    from threadpar.demo.cli import DemoConfig

    if monkeypatch is not None:
        monkeypatch.setattr(train, "graphed_step", lambda fn, **_: fn)
    cfg = DemoConfig(gpus=4, steps=6, seq_len=16, batch_size=8, cuda_graphs=cuda_graphs, out=None, **layout)
    state = prepare(cfg)
    grid = {axis: layout.get(axis, 1) for axis in ("dp", "tp", "pp", "cp")}
    run_fake_gpus(lambda: train.train_rank(state), 4, FakeCuda(), **grid)
    norms = [math.nan if n is None else n for n in state.grad_norms]
    return torch.tensor(state.losses), torch.tensor(norms)


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_the_demos_graphed_steps_equal_the_same_steps_run_eagerly(layout, monkeypatch):
    # The same device step (capturable or fused AdamW, experts padded to capacity), graphed and not: exactly.
    graphed = run_demo(layout, True)
    eager = run_demo(layout, True, monkeypatch)
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0, equal_nan=True)


def test_the_demos_graphed_steps_train_as_its_plain_eager_steps_do():
    # (graphed, AdamW runs capturable: its arithmetic on tensors may differ in the last bits)
    layout = LAYOUTS["pp2 x dp2, 1F1B"]
    torch.testing.assert_close(run_demo(layout, True), run_demo(layout, False))


@pytest.mark.parametrize(("zero", "sp"), [(0, True), (2, False)])
def test_the_demos_graphed_fp16_steps_skip_overflows_as_its_eager_steps_do(zero, sp):
    """fp16 with loss scaling: the graphed step skips on the device (LossScaler's device path, the fused
    AdamW reading the agreed flag), the eager one on the host. From a start scale of 2**22 this model's fp16
    gradients overflow at steps 0-3 and 5 (measured; 3 and 5 inside replays, after 3 warm-up steps), so the
    replays skip, step, skip and step again."""
    from threadpar.demo.__main__ import prepare
    from threadpar.demo.cli import DemoConfig
    from threadpar.demo.train import train_rank

    def run(cuda_graphs: bool):
        cfg = DemoConfig(
            gpus=4, dp=2, tp=2, pp=1, steps=8, seq_len=16, batch_size=8, zero=zero, sequence_parallel=sp,
            dtype="fp16", cuda_graphs=cuda_graphs, out=None,
        )  # fmt: skip
        state = prepare(cfg)
        state.scaler_state = {"scale": 2.0**22, "good_steps": 0, "skipped_steps": 0}
        run_fake_gpus(lambda: train_rank(state), 4, FakeCuda(), dp=2, tp=2)
        return state

    graphed, eager = run(True), run(False)
    assert graphed.skipped_steps == eager.skipped_steps == 5
    assert graphed.final_scaler_state == eager.final_scaler_state == {
        "scale": 2.0**17, "good_steps": 2, "skipped_steps": 5
    }  # fmt: skip
    skipped = [n is None for n in eager.grad_norms]
    assert [n is None for n in graphed.grad_norms] == skipped == [True] * 4 + [False, True, False, False]
    # The eager run's AdamW is the foreach one, the graphed run's fused and capturable: their last bits differ,
    # and fp16 autocast can round them further apart (up to 1.6e-4 relative in a loss, measured on this model
    # over 6 steps from the default scale); a step taken or skipped wrongly moves the next loss by ~0.4 here.
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses), rtol=2e-3, atol=0)
    norms = [(g, e) for g, e in zip(graphed.grad_norms, eager.grad_norms) if e is not None]
    torch.testing.assert_close(torch.tensor(norms)[:, 0], torch.tensor(norms)[:, 1], rtol=2e-3, atol=0)


def test_the_demo_says_what_it_cannot_graph():
    from threadpar.demo.cli import DemoConfig

    with pytest.raises(
        threadpar.ConfigError, match=r"cannot graph this run: --moe-experts without --moe-capacity-factor"
    ):
        DemoConfig(gpus=2, moe_experts=4, cuda_graphs=True)
    DemoConfig(gpus=2, moe_experts=4, moe_capacity_factor=1.25, cuda_graphs=True)  # (padded to capacity)
    DemoConfig(gpus=2, pp=1, dtype="fp16", cuda_graphs=True)  # (graphed: the loss scaler's device path)
    DemoConfig(gpus=8, cuda_graphs=True)  # (pp 2: the stages' point to point is graphed too)


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


def test_the_demos_gpu_path_runs_end_to_end_on_the_doubles_gpus(tmp_path, capsys):
    """`python -m threadpar.demo --gpus 8` as a GPU node runs it: the library places the ranks on 8 GPUs of
    the nccl backend (here the double's, simgpu:0..7) and every step's tensors live there."""
    from fakes.fake_cuda_nccl import simulated_gpus

    from threadpar.demo.__main__ import main

    argv = ["--gpus", "8", "--steps", "3", "--seq-len", "16", "--batch-size", "8", "--out", str(tmp_path)]
    fake = FakeCuda()
    with simulated_gpus(fake, 8):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "8 ranks on 8 GPUs (NCCL)" in out and "loss" in out
    used = {c.stream.device_index for c in fake.calls}
    assert used == set(range(8)) and fake.calls_named("all_reduce")  # (every GPU issued NCCL calls)
    assert not fake.nccl.violations
