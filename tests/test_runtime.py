"""The rank context: accessors, per-rank generators, intra-op threads, device placement, printing."""

import threading

import pytest
import torch

import threadpar
import threadpar.runtime.devices as devices_module
from threadpar.runtime.devices import resolve_placement
from threadpar.runtime.launch import available_cores
from threadpar.runtime.rank_cores import can_pin, gil_enabled
from threadpar.testing import on_ranks, run_ranks


def test_accessors_inside_ranks():
    def body():
        return (
            threadpar.get_rank(),
            threadpar.get_world_size(),
            threadpar.get_device(),
            threadpar.get_coords(),
            threadpar.get_thread_rank(),
            threadpar.get_process_rank(),
            threadpar.is_main_rank(),
            threadpar.get_layout().describe(),
            threadpar.comm.get_rank("TP"),
            threadpar.comm.get_world_size("DP"),
        )

    res = run_ranks(body, 4, tp=2)
    assert [r[0] for r in res] == [0, 1, 2, 3]
    assert all(r[1] == 4 and r[2] == torch.device("cpu") for r in res)
    assert res[3][3] == threadpar.Coords(dp=1, tp=1, pp=0)
    assert [r[4] for r in res] == [0, 1, 2, 3] and all(r[5] == 0 for r in res)
    assert [r[6] for r in res] == [True, False, False, False]
    assert "dp=2" in res[0][7] and "tp=2" in res[0][7]
    assert [r[8] for r in res] == [0, 1, 0, 1] and all(r[9] == 2 for r in res)


def test_generators_differ_across_ranks_and_repeat_across_launches():
    def body():
        return torch.rand(4, generator=threadpar.get_generator())

    a, b = run_ranks(body, 2, seed=5), run_ranks(body, 2, seed=5)
    c = run_ranks(body, 2, seed=6)
    assert not torch.equal(a[0], a[1])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_intraop_threads_are_set_per_rank_and_restored():
    before = torch.get_num_threads()
    got = run_ranks(lambda: torch.get_num_threads(), 2, intraop_threads=1)
    assert got == [1, 1]
    assert torch.get_num_threads() == before
    default = run_ranks(lambda: torch.get_num_threads(), 2)
    # Two CPU ranks share one core by default (LaunchConfig.rank_cores), where threads can be pinned and
    # the GIL is on.
    assert default == [1 if can_pin() and gil_enabled() else max(1, available_cores() // 2)] * 2


def test_a_rank_keeps_its_intraop_threads_when_another_thread_sets_torchs():
    """torch.set_num_threads in another thread (another launch's ranks, the caller's code) must not change a
    rank's count: torch sets a thread's count from the process-wide one at its first parallel op
    (ATen/Parallel.h, lazy_init_num_threads), so a rank that set its own before then lost it to whoever
    set torch's last. Deterministic here: the other thread sets 3 after the rank's start, before its
    first op (torch_distributed=False: no c10d set-up runs an op in between)."""
    started, changed = threading.Event(), threading.Event()
    saved = torch.get_num_threads()

    def meddle():
        started.wait(10)
        torch.set_num_threads(3)
        changed.set()

    def body():
        started.set()
        changed.wait(10)
        return torch.get_num_threads()

    other = threading.Thread(target=meddle)
    other.start()
    try:
        got = run_ranks(body, 1, intraop_threads=2, torch_distributed=False)
    finally:
        other.join()
        torch.set_num_threads(saved)  # torch's process-wide count, which the other thread changed
    assert changed.is_set() and got == [2]


def test_results_come_back_indexed_by_rank_with_args_and_kwargs():
    def body(a, b=0):
        return a + b + threadpar.get_rank()

    assert threadpar.launch(body, 10, kwargs={"b": 5}, world_size=3, devices="cpu") == [15, 16, 17]


@on_ranks(4, tp=2)
def test_on_ranks_decorator_runs_the_body_on_every_rank():
    t = torch.ones(1)
    threadpar.all_reduce(t, group="TP")
    assert t.item() == 2.0


def test_on_ranks_reraises_the_ranks_own_assertion():
    @on_ranks(2)
    def failing():
        assert threadpar.get_rank() == 0, "rank 1 disagrees"

    with pytest.raises(AssertionError, match="rank 1 disagrees"):
        failing()


def test_print_helpers(capsys):
    def body():
        threadpar.print0("only once")
        threadpar.rank_print("from", threadpar.get_rank())

    run_ranks(body, 3)
    out = capsys.readouterr().out.splitlines()
    assert out.count("only once") == 1
    assert sorted(line for line in out if line.startswith("[rank")) == [
        "[rank 0] from 0",
        "[rank 1] from 1",
        "[rank 2] from 2",
    ]


def test_print_layout_prints_the_overview(capsys):
    threadpar.launch(lambda: None, world_size=4, tp=2, devices="cpu", print_layout=True)
    out = capsys.readouterr().out
    assert "4 ranks = pp=1 x dp=2 x tp=2" in out and "TP1[2,3]" in out


class TestPlacement:
    def test_cpu_when_no_gpu(self):
        p = resolve_placement(4, None, 1, None, "auto", n_cuda=0)
        assert p.backend == "threads" and p.devices == (torch.device("cpu"),) * 4
        assert "running 4 ranks as CPU threads" in p.note

    def test_nccl_when_enough_gpus(self):
        p = resolve_placement(None, None, 1, None, "auto", n_cuda=8, nccl=True)
        assert p.world_size == 8 and p.backend == "nccl" and p.devices[7] == torch.device("cuda", 7)
        p = resolve_placement(None, [2, 5], 1, None, "auto", n_cuda=8, nccl=True)
        assert p.devices == (torch.device("cuda", 2), torch.device("cuda", 5))
        p = resolve_placement(2, None, 1, None, "threads", n_cuda=2, nccl=True)
        assert p.backend == "threads" and [d.index for d in p.devices] == [0, 1] and p.note is None

    def test_more_ranks_than_gpus_share_them_round_robin_over_threads_with_a_note(self):
        # Issue 29: rank r on cuda:ids[r % len(ids)]; NCCL cannot have two ranks of a communicator on one GPU.
        p = resolve_placement(8, None, 1, None, "auto", n_cuda=3, nccl=True)
        assert p.backend == "threads" and [d.index for d in p.devices] == [0, 1, 2, 0, 1, 2, 0, 1]
        assert "8 ranks share 3 GPU(s) (round-robin)" in p.note and "Duplicate GPU detected" in p.note
        assert "\n" not in p.note
        p = resolve_placement(4, [1], 1, None, "auto", n_cuda=2, nccl=False)
        assert p.backend == "threads" and p.devices == (torch.device("cuda", 1),) * 4
        p = resolve_placement(4, None, 1, None, "threads", n_cuda=1, nccl=True)  # chosen: nothing to explain
        assert p.backend == "threads" and p.devices == (torch.device("cuda", 0),) * 4 and p.note is None
        p = resolve_placement(None, None, 1, 4, "auto", n_cuda=1, nccl=True)  # dp=4 on one GPU
        assert p.world_size == 4 and p.backend == "threads"

    def test_a_device_named_twice_is_shared_by_those_ranks(self):
        p = resolve_placement(None, [0, 0, 1, 1], 1, None, "auto", n_cuda=2, nccl=True)
        assert p.backend == "threads" and [d.index for d in p.devices] == [0, 0, 1, 1]
        assert "as devices= names them" in p.note
        p = resolve_placement(None, ["cuda:1", "cuda:1"], 1, None, "threads", n_cuda=2, nccl=True)
        assert p.devices == (torch.device("cuda", 1),) * 2 and p.note is None

    @pytest.mark.parametrize("devices", [None, [0, 0, 1, 1], [1]])
    def test_nccl_with_shared_gpus_is_refused_naming_nccls_reason_and_the_fix(self, devices):
        with pytest.raises(threadpar.ConfigError) as info:
            resolve_placement(4, devices, 1, None, "nccl", n_cuda=2, nccl=True)
        text = str(info.value)
        assert "backend='nccl' with 4 ranks on" in text and "Duplicate GPU detected" in text
        assert "src/init.cc" in text and "backend='threads'" in text

    def test_auto_without_nccl_falls_back_to_threads_with_a_note(self, monkeypatch):
        # Issue 14, defect 10: a CUDA build without NCCL. The query itself is what is patched here.
        monkeypatch.setattr(devices_module, "nccl_built", lambda: False)
        p = resolve_placement(2, None, 1, None, "auto", n_cuda=2)
        assert p.backend == "threads" and p.devices == (torch.device("cuda", 0), torch.device("cuda", 1))
        assert "has no NCCL" in p.note and "backend 'threads'" in p.note and "\n" not in p.note
        with pytest.raises(threadpar.ConfigError, match=r"backend='nccl': this torch build .* has no NCCL"):
            resolve_placement(2, None, 1, None, "nccl", n_cuda=2)
        monkeypatch.setattr(devices_module, "nccl_built", lambda: True)
        assert resolve_placement(2, None, 1, None, "auto", n_cuda=2).backend == "nccl"

    def test_cpu_requested_and_int_devices(self):
        p = resolve_placement(None, 3, 1, None, "auto", n_cuda=0)
        assert p.world_size == 3 and p.backend == "threads"
        p = resolve_placement(2, "cpu", 1, None, "auto", n_cuda=8)
        assert p.devices == (torch.device("cpu"),) * 2 and p.note is None
        with pytest.raises(threadpar.ConfigError, match="asks for CUDA devices"):
            resolve_placement(None, [0, 9], 1, None, "auto", n_cuda=2)
        with pytest.raises(threadpar.ConfigError, match="is not one of"):
            resolve_placement(2, None, 1, None, "gloo", n_cuda=0)
