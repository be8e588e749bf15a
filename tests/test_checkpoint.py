"""Unsplit checkpoints: a plain GPT loads them, and runs resume on any layout with the same losses."""

import pytest
import torch
from helpers.gpt_reference import train_losses

from threadpar.demo.__main__ import run_demo
from threadpar.demo.cli import DemoConfig
from threadpar.demo.data import Batches, load_tokens
from threadpar.demo.train import make_optimizer
from threadpar.models.gpt import GPT, model_config

COMMON = dict(model="tiny", seq_len=16, batch_size=8, microbatches=2, out=None, lr=1e-2, seed=3)


def demo(checkpoint, *, steps, resume=False, **layout):
    """Train on 4 rank threads, saving (and with resume=True first loading) checkpoint/checkpoint.pt."""
    return run_demo(DemoConfig(gpus=4, steps=steps, checkpoint=checkpoint, resume=resume, **layout, **COMMON))


def single_thread_losses(steps):
    gpt = model_config("tiny", block_size=16)
    model = GPT(gpt).init_weights(torch.Generator().manual_seed(COMMON["seed"]))
    optimizer = make_optimizer(model.parameters(), COMMON["lr"])
    batches = Batches(load_tokens(None), COMMON["batch_size"], 16, COMMON["seed"])
    # The demo clips the gradient norm (--clip-grad, default 1.0): so does the reference, with torch's function.
    return model, train_losses(model, optimizer, batches, steps, max_norm=DemoConfig.clip_grad)


def test_checkpoint_loads_into_a_plain_gpt_with_the_single_thread_weights(tmp_path):
    run = demo(tmp_path / "a", steps=3, dp=1, tp=2, pp=2)
    plain = GPT.from_checkpoint(str(tmp_path / "a" / "checkpoint.pt"))
    reference, losses = single_thread_losses(3)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    # atol 1e-4: the key bias has an exactly-zero true gradient (softmax ignores a per-row constant), so
    # Adam turns float noise into updates there; a wrongly gathered shard would be off by ~lr = 1e-2.
    for (name, p), (_, q) in zip(plain.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "resume_layout", [dict(dp=1, tp=2, pp=2), dict(dp=2, tp=1, pp=2), dict(dp=4, tp=1, pp=1)]
)
def test_resumed_run_continues_the_uninterrupted_one(tmp_path, resume_layout):
    whole = demo(tmp_path / "whole", steps=6, dp=1, tp=2, pp=2)
    demo(tmp_path / "run", steps=3, dp=1, tp=2, pp=2)  # interrupted after step 3
    resumed = demo(tmp_path / "run", steps=6, resume=True, **resume_layout)
    assert len(resumed.losses) == 3
    same_layout = resume_layout == dict(dp=1, tp=2, pp=2)
    # Same layout: the same arithmetic in the same order. Another layout: sums in another order.
    tol = dict(rtol=1e-6, atol=1e-6) if same_layout else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(whole.losses[3:]), **tol)


def test_resume_refuses_another_model_or_data(tmp_path):
    from threadpar.errors import ConfigError

    demo(tmp_path / "a", steps=2, dp=4, tp=1, pp=1)
    cfg = DemoConfig(gpus=4, steps=4, checkpoint=tmp_path / "a", resume=True, **{**COMMON, "seed": 4})
    with pytest.raises(ConfigError, match="pass the same --data and --seed"):
        run_demo(cfg)
    cfg = DemoConfig(gpus=4, steps=4, checkpoint=tmp_path / "a", resume=True, **{**COMMON, "seq_len": 32})
    with pytest.raises(ConfigError, match="pass the --model and --seq-len it was written with"):
        run_demo(cfg)


def test_moe_checkpoint_is_dense_and_resumes_on_another_ep_and_layout(tmp_path):
    """Experts sharded over ep=2 are saved as dense [E, ...] tensors; a run resumed with every expert on
    every rank (ep=1, another layout) continues the uninterrupted one. Same dp x microbatches: a MoE routes
    per forward, so the same forwards give the same aux losses."""
    moe = dict(moe_experts=4, ep=2)
    whole = demo(tmp_path / "whole", steps=4, dp=2, tp=2, pp=1, **moe)
    demo(tmp_path / "run", steps=2, dp=2, tp=2, pp=1, **moe)
    plain = GPT.from_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))
    assert plain.config.moe_experts == 4
    assert plain.blocks["0"].mlp.experts.fc1_weight.shape == (4, 64, 256)
    resumed = demo(tmp_path / "run", steps=4, resume=True, dp=2, tp=1, pp=2, moe_experts=4, ep=1)
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[2:]), rtol=1e-4, atol=1e-5
    )
