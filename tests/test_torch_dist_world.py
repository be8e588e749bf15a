"""torch.distributed's world in the rank threads of a launch: on by default, off on request, a tutorial's
init/destroy_process_group accepted, the layout as a DeviceMesh, the caller's world untouched, and
threadpar's guarantees (order check, stop on failure, timeouts naming ranks) through torch's API."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import threadpar
from threadpar import CollectiveMismatchError, CollectiveTimeoutError, ConfigError, RankFailedError


def launch(body, **options):
    options = {"world_size": 2, "devices": "cpu", "timeout": 20} | options
    return threadpar.launch(body, **options)


def test_each_rank_thread_starts_initialised_as_its_rank():
    def body():
        return (
            dist.is_initialized(),
            dist.get_rank(),
            dist.get_world_size(),
            dist.get_backend(),
            dist.get_process_group_ranks(dist.group.WORLD),
        )

    assert launch(body, world_size=3) == [(True, r, 3, "threadpar", [0, 1, 2]) for r in range(3)]


def test_turned_off_gives_torchs_own_not_initialized_error():
    def body():
        assert not dist.is_initialized()
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            dist.all_reduce(torch.ones(1))
        return True

    assert launch(body, torch_distributed=False) == [True, True]


def test_a_tutorials_init_and_destroy_are_accepted(capsys):
    def body(rank_arg):
        rank = dist.get_rank() if rank_arg else -1
        dist.init_process_group("gloo", rank=rank, world_size=2)  # as a tutorial would, backend mapped
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        gone = not dist.is_initialized()
        dist.init_process_group(backend="nccl")  # again, after destroying: initialised anew
        u = torch.ones(1)
        dist.all_reduce(u)
        return t.item(), gone, u.item()

    assert launch(body, kwargs={"rank_arg": True}) == [(2.0, True, 2.0)] * 2
    out = capsys.readouterr().out
    assert out.count("threadpar: init_process_group(backend 'gloo') runs on the 'threadpar' backend") == 1


def test_init_with_another_rank_or_world_size_is_a_config_error():
    def body():
        if dist.get_rank() == 0:
            dist.init_process_group("gloo", rank=1, world_size=2)

    with pytest.raises(RankFailedError) as failed:
        launch(body)
    assert isinstance(failed.value.error, ConfigError)
    assert "init_process_group(rank=1, world_size=2)" in str(failed.value.error)
    assert "rank 0 of world size 2" in str(failed.value.error)

    def wrong_size():
        if dist.get_rank() == 1:
            dist.init_process_group("gloo", world_size=8)

    with pytest.raises(RankFailedError, match=r"world_size=8\).*rank 1 of world size 2"):
        launch(wrong_size)


def test_the_layout_as_a_device_mesh_shares_the_groups():
    def body():
        mesh = threadpar.device_mesh()
        tp = mesh.get_group("tp")
        dp = mesh["dp"].get_group()
        same = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_ranks = threadpar.get_group("TP").ranks
        return (
            mesh.mesh_dim_names,
            tuple(dist.get_process_group_ranks(tp)) == tp_ranks,
            tuple(dist.get_process_group_ranks(dp)) == threadpar.get_group("DP").ranks,
            tp.threadpar_group is threadpar.get_group("TP"),
            same.get_group("tp").threadpar_group is threadpar.get_group("TP"),
            threadpar.device_mesh(mesh_dim_names=("tp", "dp")).mesh.tolist(),
        )

    for names, tp_ok, dp_ok, tp_same, init_same, transposed in launch(body, world_size=4, tp=2):
        assert names == ("dp", "tp") and tp_ok and dp_ok and tp_same and init_same
        assert transposed == [[0, 2], [1, 3]]


def test_a_mesh_that_does_not_fit_says_which_would():
    def body():
        threadpar.device_mesh((4,), ("tp",))

    with pytest.raises(RankFailedError) as failed:
        launch(body, world_size=4, tp=2)
    assert isinstance(failed.value.error, ConfigError)
    assert "mesh_shape=(2, 2) with mesh_dim_names=('dp', 'tp')" in str(failed.value.error)


def test_the_callers_world_is_as_before():
    assert not dist.is_initialized()
    launch(lambda: dist.all_reduce(torch.ones(1)))
    assert not dist.is_initialized()

    # A caller with its own group (as under torchrun, where threadpar's processes hold a gloo group).
    def caller():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            before = dist.group.WORLD
            launch(lambda: dist.all_reduce(torch.ones(1)))
            t = torch.ones(2)
            dist.all_reduce(t)
            import torch.distributed._functional_collectives as funcol

            u = funcol.wait_tensor(funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD))
            return dist.group.WORLD is before, dist.get_backend(), t.tolist(), u.item()
        finally:
            dist.destroy_process_group()

    result: list = []
    thread = threading.Thread(target=lambda: result.append(caller()))
    thread.start()
    thread.join(60)
    assert result == [(True, "gloo", [1.0, 1.0], 1.0)]
    assert not dist.is_initialized()


def test_an_op_threadpar_cannot_do_names_op_and_group():
    def body():
        dist.group.WORLD.allreduce_sparse([torch.ones(1).to_sparse()])

    with pytest.raises(RankFailedError) as failed:
        launch(body)
    assert isinstance(failed.value.error, NotImplementedError)
    assert "allreduce_sparse on group 'WORLD'" in str(failed.value.error)


def test_mismatched_collectives_raise_on_every_member():
    def body():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)

    with pytest.raises(RankFailedError) as failed:
        launch(body)
    assert isinstance(failed.value.error, CollectiveMismatchError)


def test_a_missing_rank_times_out_naming_it():
    def body():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailedError) as failed:
        launch(body, timeout=1.0)
    assert isinstance(failed.value.error, CollectiveTimeoutError)
    assert "all_reduce(float32[1], op=SUM)" in str(failed.value.error)
    assert "ranks [1] did not arrive" in str(failed.value.error)


def test_a_failing_rank_stops_the_others_waiting_in_torch_ops():
    def body():
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank 1")
        for _ in range(3):
            dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailedError, match="boom on rank 1") as failed:
        launch(body, timeout=60)
    assert failed.value.rank == 1


def test_across_processes_on_the_hierarchical_backend():
    """2 simulated processes x 2 rank threads: torch's world is all 4 ranks; groups span the processes."""
    from threadpar.testing import run_processes

    def body():
        r = dist.get_rank()
        t = torch.tensor([float(r)])
        dist.all_reduce(t)
        pair = dist.new_group([1, 2])  # one rank in each process
        u = torch.tensor([float(r)])
        if r in (1, 2):
            dist.all_reduce(u, group=pair)
        gathered = [None] * 4
        dist.all_gather_object(gathered, r * 10)
        return t.item(), u.item(), dist.get_world_size(), gathered

    outcomes = run_processes(body, 2, 2, devices="cpu", timeout=30)
    flat = [result for process in outcomes for result in process]
    assert [f[0] for f in flat] == [6.0] * 4
    assert [f[1] for f in flat] == [0.0, 3.0, 3.0, 3.0]
    assert all(f[2] == 4 and f[3] == [0, 10, 20, 30] for f in flat)


def test_torch_dist_builds_on_comm_and_never_on_the_runtime():
    """DESIGN.md's layers: threadpar.torch_dist sits on comm (the runtime starts its sessions)."""
    import ast
    import pathlib

    package = pathlib.Path(threadpar.__file__).parent / "torch_dist"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("threadpar.runtime"), f"{path.name} imports {name}"


def test_work_wait_with_a_timeout_raises_and_a_later_wait_succeeds():
    from datetime import timedelta

    rank0_timed_out = threading.Event()

    def body():
        t = torch.ones(1)
        if dist.get_rank() == 0:
            work = dist.all_reduce(t, async_op=True)
            with pytest.raises(CollectiveTimeoutError):
                work.wait(timedelta(seconds=0.2))  # rank 1 has not called it yet
            rank0_timed_out.set()
            work.wait()
        else:
            assert rank0_timed_out.wait(20)
            dist.all_reduce(t)
        return t.item()

    assert launch(body) == [2.0, 2.0]


def test_the_backend_outside_a_launch_says_where_it_works():
    launch(lambda: None)  # registers the backend
    with pytest.raises(ConfigError, match=r"serves the rank threads of threadpar\.launch"):
        dist.init_process_group("threadpar", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_process_env_in_a_rank_thread_is_the_process_not_the_rank():
    """Inside a rank, torch.distributed's world is the launch's ranks; process_env() still says which process
    this is (process 0 of 1 here), not the thread's rank (it said rank 1 of 2 when it read the thread's world)."""
    envs = threadpar.launch(lambda: threadpar.process_env(), world_size=2, devices="cpu")
    assert [(e.rank, e.count) for e in envs] == [(0, 1), (0, 1)]
