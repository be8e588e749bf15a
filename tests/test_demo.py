"""`python -m threadpar.demo`: flags, outputs, the --check comparison, fp16 loss scaling, the default run."""

import json
import resource
import subprocess
import sys

import pytest
import torch

import threadpar
from threadpar.demo.__main__ import main, placement, prepare, run_demo
from threadpar.demo.cli import DemoConfig, default_layout, parse_args
from threadpar.demo.data import Batches, synthetic_corpus
from threadpar.demo.process_exchange import PER_RANK_FIELDS, merge_parts
from threadpar.errors import ConfigError
from threadpar.parallel.loss_scaler import LossScaler
from threadpar.pipeline import Timeline
from threadpar.runtime.process_env import ProcessEnv
from threadpar.testing import run_ranks


def test_default_layout_uses_all_three_axes_when_it_can():
    assert default_layout(8) == (2, 2, 2)
    assert default_layout(4, ep=2) == (2, 2, 1)  # dp must be a multiple of ep: PP goes first, then TP
    assert default_layout(2, ep=2) == (2, 1, 1)
    assert (DemoConfig(gpus=8, cp=2).dp, DemoConfig(gpus=8, cp=2).tp) == (1, 2)  # the rest per CP rank
    assert default_layout(16) == (4, 2, 2)
    assert default_layout(4) == (1, 2, 2)
    assert default_layout(2) == (1, 2, 1)
    assert default_layout(3) == (3, 1, 1)
    assert parse_args([]).gpus == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gpus=8, tp=3), "--gpus 8 with --tp 3: world size 8 is not divisible by tp\\*cp\\*pp = 3"),
        (dict(gpus=8, dp=2, tp=2, pp=1), "with --dp 2 --tp 2 --pp 1: .* make the product equal 8"),
        (dict(gpus=4, dp=4, batch_size=6), "must be divisible by dp=4"),
        (dict(gpus=4, tp=2, pp=2, batch_size=6), "divisible by dp\\*microbatches = 4"),
        (dict(gpus=2, resume=True), "--resume needs --checkpoint"),
        (dict(gpus=2, model="huge"), "choose one of"),
        (dict(gpus=8, cp=3), "--cp 3: must be a positive divisor of --gpus 8"),
        (dict(gpus=8, cp=2, tp=3), "with --cp 2 --tp 3: .* not divisible by tp\\*cp\\*pp = 6"),
        (dict(gpus=8, cp=2, seq_len=18), "--seq-len 18 does not split over cp=2 .* a multiple of 4"),
        (dict(gpus=8, tp=2, sequence_parallel=True, seq_len=15), "a multiple of 2; choose --seq-len 16"),
        (dict(gpus=8, ep=2), "add --moe-experts N"),
        (dict(gpus=8, dp=1, tp=8, moe_experts=4, ep=2), "--ep 2 must divide dp=1"),
        (dict(gpus=8, moe_experts=3, ep=2), "--moe-experts 3 does not split over --ep 2"),
        (dict(gpus=8, moe_experts=2, moe_top_k=3), "--moe-top-k 3"),
    ],
)
def test_bad_flags_are_explained(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DemoConfig(**kwargs)


def test_under_torchrun_the_layout_spans_every_process_and_errors_count_all_ranks():
    cfg = DemoConfig(gpus=2, processes=2)
    assert cfg.world_size == 4 and (cfg.dp, cfg.tp, cfg.pp) == (1, 2, 2)  # default_layout(4)
    assert parse_args(["--gpus", "2", "--tp", "2", "--batch-size", "6"], processes=3).dp == 3
    with pytest.raises(
        ConfigError, match=r"--gpus 2 x 2 processes = 4 ranks with --tp 3: world size 4 is not"
    ):
        DemoConfig(gpus=2, processes=2, tp=3)
    with pytest.raises(
        ConfigError, match=r"4 ranks with --dp 1 --tp 2 --pp 1: .* but there are 4 ranks; make"
    ):
        DemoConfig(gpus=2, processes=2, dp=1, tp=2, pp=1)


def test_placement_across_processes(monkeypatch):
    cfg, env = DemoConfig(gpus=2, processes=2), ProcessEnv(rank=1, count=2, local_rank=1, local_count=2)
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 0)
    assert placement(cfg, env) == (
        "threads",
        "cpu",
        "no CUDA devices: 2 processes x 2 ranks = 4 ranks, as CPU threads",
    )
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 4)
    monkeypatch.setattr("threadpar.runtime.devices.nccl_built", lambda: True)  # a CUDA torch with NCCL
    backend, devices, line = placement(cfg, env)  # a GPU per rank: NCCL across processes, launch's GPUs
    assert (backend, devices, line) == (
        "nccl",
        None,
        "2 processes x 2 ranks = 4 ranks on 4 GPUs (NCCL, also between processes)",
    )
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 3)
    with pytest.raises(ConfigError, match="need 4 GPUs, but this process sees 3; pass a smaller --gpus"):
        placement(cfg, env)
    with pytest.raises(ConfigError, match="for 2 process\\(es\\) but this job has 1"):
        run_demo(cfg, ProcessEnv())


def test_process_zero_merges_the_other_processes_results_onto_its_clock():
    def timeline(rank, start):
        t = Timeline(rank, stage=rank // 2)
        t.record("0F0", "forward", start, start + 1.0)
        return t

    def part(host, clock, rank):
        return {
            "host": host,
            "clock": clock,
            "timelines": {rank: timeline(rank, 100.0)},
            "activation_peaks": {rank: rank + 1},
            "device_peaks": {rank: None},
            "optimizer_state_bytes": {rank: 10 * rank},
            "model_parts": {rank // 2: {f"w{rank}": torch.ones(1)}},
            "optimizer_parts": {rank // 2: {}},
        }

    run = prepare(DemoConfig(gpus=1, processes=3, batch_size=6))
    parts = [part("a", 50.0, 0), part("a", 10.0, 1), part("b", 40.0, 2)]
    for name in PER_RANK_FIELDS:  # process 0's own ranks are in its RunState already
        getattr(run, name).update(parts[0][name])
    merge_parts(run, parts)
    assert run.activation_peaks == {0: 1, 1: 2, 2: 3}
    assert run.optimizer_state_bytes == {0: 0, 1: 10, 2: 20}
    assert set(run.model_parts) == {0, 1} and set(run.model_parts[1]) == {"w2"}
    starts = {r: t.events[0].start for r, t in run.timelines.items()}
    assert starts == {0: 100.0, 1: 100.0, 2: 110.0}  # same machine: one clock; another: shifted by 50 - 40


def test_batches_are_a_function_of_seed_and_step():
    tokens = torch.frombuffer(bytearray(synthetic_corpus(1 << 14)), dtype=torch.uint8)
    a, b = Batches(tokens, 4, 8, seed=1), Batches(tokens, 4, 8, seed=1)
    assert torch.equal(a.batch(5)[0], b.batch(5)[0])
    assert not torch.equal(a.batch(5)[0], a.batch(6)[0])
    x, y = a.batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_fewer_gpus_than_ranks_says_what_it_does(monkeypatch):
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 2)
    backend, devices, line = placement(DemoConfig(gpus=8))  # the 8 ranks share the 2 GPUs (issue 29)
    assert (backend, devices) == ("threads", None) and "8 ranks on 2 GPU(s), sharing them" in line
    assert "--gpus 2" in line
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 0)
    assert placement(DemoConfig(gpus=8))[1] == "cpu"
    monkeypatch.setattr("threadpar.demo.__main__.cuda_device_count", lambda: 8)
    monkeypatch.setattr("threadpar.runtime.devices.nccl_built", lambda: False)  # issue 14, defect 10
    assert placement(DemoConfig(gpus=8)) == (
        "threads",
        None,
        "8 ranks on 8 GPUs (no NCCL in this torch: threads)",
    )


def test_demo_writes_its_outputs_and_matches_the_single_thread_model(tmp_path, capsys):
    args = ["--gpus", "4", "--steps", "4", "--seq-len", "16", "--batch-size", "8", "--out", str(tmp_path)]
    assert main([*args, "--check", "--schedule", "interleaved", "--model", "small"]) == 0
    out = capsys.readouterr().out
    assert "rank  dp  tp  pp" in out  # the layout overview
    assert "check vs single-thread model, first 3 steps: match" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["losses"]) == 4 and metrics["layout"] == {"dp": 1, "tp": 2, "pp": 2}
    assert metrics["check"]["ok"] and 0 <= metrics["bubble"] < 1
    assert set(metrics["peak_memory"]) == {"0", "1", "2", "3"}
    for name in ("loss.png", "timeline.png", "trace.json"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["cat"] for e in trace["traceEvents"] if "cat" in e} >= {"forward", "backward"}


@pytest.mark.parametrize("schedule", ["zbh1", "zb_interleaved", "zbv"])
def test_demo_with_a_zero_bubble_schedule_matches_the_single_thread_model(tmp_path, capsys, schedule):
    micro = "3" if schedule == "zbv" else "2"  # zbv needs n >= 2 pp - 1
    batch = "12" if schedule == "zbv" else "8"
    args = ["--gpus", "4", "--steps", "3", "--seq-len", "16", "--batch-size", batch, "--out", str(tmp_path)]
    assert main([*args, "--check", "--schedule", schedule, "--model", "small", "--microbatches", micro]) == 0
    out = capsys.readouterr().out
    assert "check vs single-thread model, first 3 steps: match" in out
    assert "waiting for messages" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["cat"] for e in trace["traceEvents"] if "cat" in e} >= {"forward", "backward", "weight"}


def test_demo_with_context_parallelism_and_moe_over_ep_matches_the_single_thread_model(tmp_path, capsys):
    args = ["--gpus", "4", "--cp", "2", "--moe-experts", "4", "--ep", "2", "--steps", "3", "--seq-len", "16"]
    assert main([*args, "--batch-size", "8", "--check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout dp=2 x cp=2 x tp=1 x pp=1 (experts over ep=2)" in out
    assert "check vs single-thread model, first 3 steps: match" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["layout"] == {"dp": 2, "cp": 2, "tp": 1, "pp": 1, "ep": 2}
    assert metrics["moe"] == {"experts": 4, "top_k": 2, "capacity_factor": None, "ep": 2}  # (dropless)
    assert all(0 < aux < 0.1 for aux in metrics["aux_losses"])  # the aux loss is part of the loss


def test_bad_flags_exit_with_a_message(capsys):
    assert main(["--gpus", "8", "--tp", "3"]) == 2
    assert "not divisible by tp*cp*pp" in capsys.readouterr().err


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    def body():
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.full((3,), 8.0)
        if threadpar.get_rank() == 2:
            param.grad[1] = float("inf")
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler = LossScaler(threadpar.get_group(), init_scale=4.0)
        stepped = scaler.step(optimizer, [param])
        return stepped, scaler.scale, param.detach().clone()

    for stepped, scale, param in run_ranks(body, 4):
        assert not stepped and scale == 2.0
        assert torch.equal(param, torch.ones(3))  # nobody stepped


def test_fp16_demo_runs_with_agreed_loss_scaling_and_tracks_the_fp32_run(tmp_path):
    args = ["--gpus", "4", "--steps", "3", "--seq-len", "16", "--batch-size", "8"]
    runs = {}
    for dtype in ("fp32", "fp16"):
        assert main([*args, "--out", str(tmp_path / dtype), "--dtype", dtype]) == 0
        runs[dtype] = json.loads((tmp_path / dtype / "metrics.json").read_text())
    fp32, fp16 = runs["fp32"]["losses"], runs["fp16"]["losses"]
    assert len(fp16) == 3 and runs["fp16"]["skipped_steps"] == 0  # the scaler agreed on every step
    assert fp16 != fp32  # autocast to fp16 did run
    # fp16 autocast of this tiny GPT moves each loss by ~5e-4 (measured); 2e-2 is a 40x margin, not noise: the
    # numerics are deterministic, so a busy machine cannot move them.
    torch.testing.assert_close(fp16, fp32, rtol=0, atol=2e-2)


# The issue this test comes from asks for the default run in under 2 minutes on 2 cores. Wall time on a shared
# machine says little, so the check is on CPU time: 2 cores x 120 s. Measured: 48 CPU-s (124 s wall while
# 8 agents shared the 2 cores).
DEFAULT_RUN_CPU_BUDGET_S = 2 * 120


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_default_demo_run_learns_and_finishes_in_time(tmp_path):
    """`python -m threadpar.demo --gpus 8` as a user runs it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "threadpar.demo", "--gpus", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the demo's process only: it has been waited for
    cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert cpu_seconds < DEFAULT_RUN_CPU_BUDGET_S, cpu_seconds
    losses = json.loads((tmp_path / "metrics.json").read_text())["losses"]
    assert len(losses) == 100
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])
