"""The demo's --clip-grad: the whole model's gradient norm per step in metrics.json and the summary, equal to
torch's clip_grad_norm_ on the single-thread model (--check), and the flag's bad values."""

import json

import pytest
import torch

from threadpar.demo.__main__ import main
from threadpar.demo.cli import DemoConfig

ARGS = ["--gpus", "8", "--steps", "3", "--seq-len", "16", "--batch-size", "8"]


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel", "--dp", "2", "--tp", "2", "--pp", "2"]])
def test_clipped_run_reports_the_norm_torch_computes_on_the_single_thread_model(tmp_path, capsys, extra):
    assert main([*ARGS, *extra, "--check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["clip_grad"] == 1.0 and len(metrics["grad_norms"]) == 3
    assert "gradient norm" in out and "clipped to 1 in" in out
    assert metrics["check"]["ok"]  # the losses match the reference, which clips with torch's own function
    norms = metrics["check"]["grad_norms"]
    assert norms["reference"][0] > 1.0  # the first step is really clipped
    torch.testing.assert_close(
        torch.tensor(norms["parallel"]), torch.tensor(norms["reference"]), rtol=1e-4, atol=0
    )


def test_clip_grad_zero_measures_without_clipping(tmp_path, capsys):
    assert main([*ARGS, "--clip-grad", "0", "--out", str(tmp_path)]) == 0
    assert "not clipped" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["clip_grad"] == 0 and all(n > 0 for n in metrics["grad_norms"])


def test_a_negative_clip_grad_is_refused():
    with pytest.raises(ValueError, match=r"--clip-grad -1\.0: the largest gradient norm"):
        DemoConfig(gpus=8, clip_grad=-1.0)
