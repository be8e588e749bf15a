"""Scripts written for torchrun on rank threads: threadpar.run_script and `python -m threadpar.run` (threadpar/run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import threadpar
from threadpar.errors import RankFailedError
from threadpar.run import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "torchrun_script.py")
LOSSES = re.compile(r"rank (\d+) \(local (\d+)\) losses: \[([^\]]*)\]")


def _reference_losses(world_size: int, steps: int, hidden: int) -> list[list[float]]:
    """The script's training on one thread: each rank's batch and dropout mask from its own generator seeded
    100 + rank (what torch.manual_seed(100 + rank) gives a process), gradients averaged over the ranks."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generators = [torch.Generator().manual_seed(100 + rank) for rank in range(world_size)]
    losses: list[list[float]] = [[] for _ in range(world_size)]
    for _ in range(steps):
        grads = []
        for rank, generator in enumerate(generators):
            x = torch.randn(32, 16, generator=generator)
            h = torch.relu(model[0](x))
            noise = torch.empty_like(h).bernoulli_(0.9, generator=generator).div_(0.9)  # F.dropout on CPU
            loss = torch.nn.functional.mse_loss(model[3](h * noise), x.sum(dim=1, keepdim=True))
            model.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            losses[rank].append(loss.item())
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = torch.stack(per_rank).mean(dim=0)
        optimizer.step()
    return losses


def _losses(text: str) -> dict[int, list[float]]:
    return {int(m[1]): [float(v) for v in m[3].split()] for m in LOSSES.finditer(text)}


def test_run_script_trains_as_torchrun_would(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt.pt"
    modules = threadpar.run_script(SCRIPT, ["--steps", "3", "--checkpoint", str(checkpoint)], 4)
    assert modules == [None] * 4  # every rank ended with sys.exit(0)
    got = _losses(capsys.readouterr().out)
    expected = _reference_losses(4, 3, 64)
    assert sorted(got) == [0, 1, 2, 3]
    for rank in range(4):
        torch.testing.assert_close(
            torch.tensor(got[rank]), torch.tensor(expected[rank]), rtol=1e-5, atol=1e-5
        )
    assert set(torch.load(checkpoint)) == {"0.weight", "0.bias", "3.weight", "3.bias"}  # written by rank 0


def test_each_rank_runs_the_script_in_globals_of_its_own(tmp_path):
    script = tmp_path / "counter.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            runs = globals().get("runs", 0) + 1
            rank = int(os.environ["RANK"])
            argv = list(sys.argv)
            """
        )
    )
    modules = threadpar.run_script(str(script), ["--flag"], 3)
    assert [m.rank for m in modules] == [0, 1, 2] and [m.runs for m in modules] == [1, 1, 1]
    assert modules[0].argv == [str(script), "--flag"] and modules[0].__name__ == "__main__"
    assert sys.argv[1:] != ["--flag"]  # the caller's argv again


def test_a_failing_script_names_its_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(2)\n")
    with pytest.raises(RankFailedError, match="rank 1 exited with code 2"):
        threadpar.run_script(str(script), [], 2)


def test_unknown_and_unsupported_torchrun_options_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.parse(["--bogus-option", "3", "train.py"])
    assert "--bogus-option" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--max-restarts"):
        cli.parse(["--max-restarts", "2", "train.py"])
    args = cli.parse(
        ["--nproc_per_node=4", "--standalone", "--start-method", "fork", "train.py", "--lr", "1"]
    )
    assert (cli.nproc(args), cli.nodes(args), args.training_script_args) == (4, 1, ["--lr", "1"])


def test_several_nodes_are_torchrun_processes_of_rank_threads():
    argv = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--tee",
        "3",
        "--rdzv-endpoint",
        "host:29400",
        "train.py",
        "--x",
    ]
    command = cli.torchrun_command(argv, cli.parse(argv))
    assert command[1:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--rdzv-endpoint", "host:29400", "--nproc-per-node", "1",
        "-m", "threadpar.run", "--nproc-per-node", "4", "--tee", "3", "train.py", "--x",
    ]  # fmt: skip


def test_the_command_line_prefixes_lines_as_torchruns_tee(tmp_path, capsys):
    logs = tmp_path / "logs"
    cli.main(["--nproc-per-node", "2", "--tee", "1", "--log-dir", str(logs), SCRIPT, "--steps", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "losses" in line]
    assert sorted(line.split(":", 1)[0] for line in lines) == ["[default0]", "[default1]"]
    files = sorted(p.relative_to(logs).as_posix() for p in logs.rglob("stdout.log"))
    assert files == ["none_threadpar/attempt_0/0/stdout.log", "none_threadpar/attempt_0/1/stdout.log"]
    assert "rank 1 (local 1) losses" in (logs / "none_threadpar/attempt_0/1/stdout.log").read_text()


def test_the_command_keeps_each_ranks_lines_whole(tmp_path):
    """Through a pipe, print's text and its newline are two writes that another rank thread can come between
    (a process per rank has a buffer of its own): threadpar.run writes each rank's output whole lines at a time."""
    script = tmp_path / "chatty.py"
    script.write_text("import os\nfor i in range(2000):\n    print('rank', os.environ['RANK'], 'line', i)\n")
    done = subprocess.run(
        [sys.executable, "-m", "threadpar.run", "--nproc-per-node", "4", str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 8000 and all(re.fullmatch(r"rank \d line \d+", line) for line in lines)


GPU_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

local_rank, rank = int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"])
device = torch.device(torch.accelerator.current_accelerator().type, local_rank)  # cuda:L on a GPU node
torch.get_device_module(device).set_device(device)
dist.init_process_group("nccl")
torch.manual_seed(1234)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
ddp = DDP(model, device_ids=[local_rank])
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(100 + rank)
losses = []
for _ in range(3):
    x = torch.randn(32, 16, generator=generator).to(device)
    loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"rank {rank} (local {local_rank}) losses: [{' '.join(f'{v:.6f}' for v in losses)}]", flush=True)
dist.destroy_process_group()
sys.exit(0)
"""


def test_a_gpu_script_runs_on_the_cuda_doubles_gpus(tmp_path, capsys):
    """A torchrun script for GPUs (LOCAL_RANK's device of the machine's accelerator, backend 'nccl', DDP with
    device_ids) on rank threads of the CUDA/NCCL double's GPUs (simgpu:i: the code a GPU runs), whose losses are
    one thread's."""
    from fakes.fake_cuda_nccl import FakeCuda, simulated_gpus

    script = tmp_path / "gpu_script.py"
    script.write_text(GPU_SCRIPT)
    fake = FakeCuda()
    with simulated_gpus(fake, 4):
        assert threadpar.run_script(str(script), [], 4) == [None] * 4
    got = _losses(capsys.readouterr().out)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generators = [torch.Generator().manual_seed(100 + r) for r in range(4)]
    expected: list[list[float]] = [[] for _ in range(4)]
    for _ in range(3):
        grads = []
        for r, generator in enumerate(generators):
            x = torch.randn(32, 16, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            model.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            expected[r].append(loss.item())
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = torch.stack(per_rank).mean(dim=0)
        optimizer.step()
    assert sorted(got) == [0, 1, 2, 3]
    for r in range(4):
        torch.testing.assert_close(torch.tensor(got[r]), torch.tensor(expected[r]), rtol=1e-5, atol=1e-5)
    assert fake.calls_named("all_reduce") and not fake.nccl.violations  # (DDP's buckets through NCCL)
