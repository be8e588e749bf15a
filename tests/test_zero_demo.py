"""The demo with --zero: resumes across dp and with or without ZeRO, and reports optimizer state per rank."""

import json

import pytest
import torch

from threadpar.demo.__main__ import run_demo
from threadpar.demo.cli import DemoConfig, parse_args
from threadpar.errors import ConfigError

COMMON = dict(model="tiny", seq_len=16, batch_size=8, microbatches=2, lr=1e-2, seed=3)


def demo(checkpoint, *, steps, gpus=4, resume=False, out=None, **layout):
    options = {**COMMON, **layout}
    cfg = DemoConfig(gpus=gpus, steps=steps, checkpoint=checkpoint, resume=resume, out=out, **options)
    return run_demo(cfg)


@pytest.mark.parametrize(
    "resume", [dict(dp=2, tp=2, pp=1, zero=2), dict(dp=2, tp=1, pp=2, zero=0), dict(dp=1, tp=2, pp=2, zero=1)]
)
def test_saved_with_zero_on_dp_4_resumes_on_dp_2_or_without_zero(tmp_path, resume):
    whole = demo(tmp_path / "whole", steps=6, dp=4, tp=1, pp=1, zero=0)
    demo(tmp_path / "run", steps=3, dp=4, tp=1, pp=1, zero=1)  # interrupted after step 3
    resumed = demo(tmp_path / "run", steps=6, resume=True, **resume)
    assert len(resumed.losses) == 3
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[3:]), rtol=1e-4, atol=1e-5
    )


def test_metrics_show_optimizer_state_per_rank_halved_by_zero_on_dp_2(tmp_path):
    sizes = {}
    for zero in (0, 1, 2):
        out = tmp_path / f"zero{zero}"
        run = demo(None, steps=2, gpus=2, dp=2, tp=1, pp=1, zero=zero, out=out)
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["zero"] == zero
        sizes[zero] = metrics["optimizer_state_bytes"]
        assert sizes[zero] == {str(r): b for r, b in run.optimizer_state_bytes.items()}
    for rank in ("0", "1"):
        for zero in (1, 2):
            assert abs(sizes[zero][rank] / sizes[0][rank] - 0.5) < 0.01, sizes


def test_zero_flag():
    assert parse_args(["--zero", "2"]).zero == 2
    with pytest.raises(SystemExit):
        parse_args(["--zero", "3"])
    with pytest.raises(ConfigError, match="--zero 3"):
        DemoConfig(zero=3)


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=4, tp=1, pp=1, moe_experts=4, ep=2),  # experts sharded over expert-DP groups of 2
        dict(dp=2, tp=1, pp=2, schedule="interleaved", microbatches=4),  # two DDP chunks per stage
    ],
    ids=["moe-ep2", "interleaved"],
)
def test_zero_2_trains_like_adamw_with_experts_and_interleaved_chunks(layout):
    plain = demo(None, steps=3, zero=0, **layout)
    sharded = demo(None, steps=3, zero=2, **layout)
    torch.testing.assert_close(torch.tensor(sharded.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)
