"""Launches that span processes, with the processes simulated in this interpreter (threadpar.testing).

The simulated processes run the real multi-process path (a shared store, gloo groups, hierarchical
collectives, routed messages, failure news); only the process boundary is missing, which
test_multiprocess.py covers with torchrun.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from procs import checks

import threadpar
import threadpar.comm.common.abort
import threadpar.comm.hierarchical.group as hierarchical
from threadpar.comm.hierarchical.router import MAX_DIMS, MessageRouter, decode_header, encode_header
from threadpar.comm.nccl.bootstrap import shared_unique_id, unique_id_key
from threadpar.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError, RemoteRankError
from threadpar.runtime.launch import launch_in_process
from threadpar.runtime.launch_config import LaunchConfig
from threadpar.runtime.process_env import ProcessEnv, default_local_devices, process_env
from threadpar.testing import launch_processes, run_processes


@pytest.mark.parametrize("processes,threads", [(2, 3), (3, 2)])
def test_every_collective_and_message_matches_direct_results(processes, threads):
    # tp=2: with 3 threads per process some TP groups span processes; with 3 processes the world has 3.
    counts = run_processes(checks.run_all, processes, threads, processes, threads, tp=2)
    assert all(c > 500 for per_process in counts for c in per_process)


def test_pipeline_stages_in_different_processes_match_the_whole_model():
    # single tensors, then tuples and dicts packed into one routed message per hop
    counts = run_processes(checks.check_pipeline, 2, 2, pp=2)
    assert all(c > 0 for per_process in counts for c in per_process)


def test_ddp_over_ranks_in_different_processes_matches_one_thread_on_the_whole_batch():
    def runner(body, world):
        return [r for per_process in run_processes(body, 2, world // 2) for r in per_process]

    assert checks.check_ddp(runner, 4) == 2 * 4 * 12  # 2 optimizers x 4 ranks x (6 grads + 6 params)


def test_messages_for_a_group_the_receiving_process_has_not_created_yet_wait_for_it(monkeypatch):
    kept = threading.Event()  # set once process 1's router holds a message for a group it does not have yet
    deliver = MessageRouter._deliver

    def deliver_and_tell(router, key, *message):
        deliver(router, key, *message)
        with router._lock:
            if router._pending.get(key):
                kept.set()

    monkeypatch.setattr(MessageRouter, "_deliver", deliver_and_tell)

    def body():
        rank = threadpar.get_rank()
        if rank == 0:
            threadpar.new_group([0, 3]).send(torch.arange(3), dst=3, tag=4)
        elif rank == 3:
            assert kept.wait(timeout=30)  # the message reached this process before its group exists here
            got = threadpar.new_group([0, 3]).recv_tensor(0, tag=4)
            assert torch.equal(got, torch.arange(3))
        threadpar.barrier()
        return rank

    assert run_processes(body, 2, 2) == [[0, 1], [2, 3]]


def test_lanes_split_reductions_and_broadcasts(monkeypatch):
    monkeypatch.setattr(hierarchical, "LANE_MIN_BYTES", 8)  # lanes even for tiny tensors

    def body():
        rank = threadpar.get_rank()
        tensors = [torch.arange(n, dtype=torch.float64) * (rank + 1) for n in (3, 0, 10, 1)]
        threadpar.all_reduce_coalesced(tensors, op="avg")
        for t, n in zip(tensors, (3, 0, 10, 1)):
            torch.testing.assert_close(t, torch.arange(n, dtype=torch.float64) * 2.5)
        b = torch.full((9,), float(rank))
        threadpar.broadcast(b, src=2)
        assert torch.equal(b, torch.full((9,), 2.0))
        r = torch.arange(9, dtype=torch.int64) + rank
        threadpar.reduce(r, dst=1, op="max")
        expected = torch.arange(9) + (3 if rank == 1 else rank)
        assert torch.equal(r, expected)
        return True

    assert run_processes(body, 2, 2) == [[True, True], [True, True]]


def test_results_are_indexed_by_thread_rank_and_groups_without_local_members_are_inert():
    def body():
        rank = threadpar.get_rank()
        far = threadpar.new_group([2, 3])  # both members in process 1
        if rank in (2, 3):
            t = torch.tensor([float(rank)])
            far.all_reduce(t)
            return t.item()
        assert far.rank() == -1
        with pytest.raises(ConfigError, match="not a member"):
            far.all_reduce(torch.zeros(1))
        return rank

    assert run_processes(body, 2, 2) == [[0, 1], [5.0, 5.0]]


@pytest.mark.parametrize("numel", [4, 100_000])  # inline in the control message, and through gloo
def test_a_mismatch_between_processes_raises_on_every_rank_with_each_process_call(numel):
    def body():
        process = threadpar.get_process_rank()
        try:
            if process == 0:
                threadpar.all_reduce(torch.zeros(numel))
            else:
                threadpar.broadcast(torch.zeros(numel + 3), src=0)  # sizes differ too: gloo would abort
        except CollectiveMismatchError as error:
            return str(error)
        return "no error"

    messages = [m for per_process in run_processes(body, 2, 2) for m in per_process]
    assert all("collective mismatch on group 'WORLD'" in m for m in messages)
    assert f"process 0: #1 all_reduce(float32[{numel}], op=SUM)" in messages[0]
    assert f"process 1: #1 broadcast(float32[{numel + 3}], src=0)   <-- differs from process 0" in messages[0]


def test_all_to_all_sizes_that_disagree_between_processes_raise_instead_of_crashing():
    def body():
        rank = threadpar.get_rank()
        sends = [torch.zeros(2) for _ in range(4)]
        recvs = [torch.zeros(3 if rank == 0 else 2) for _ in range(4)]  # rank 0 expects 3 from everyone
        with pytest.raises(
            CollectiveMismatchError, match=r"process 0 sends 32 bytes to process 0, which expects 40"
        ):
            threadpar.all_to_all(recvs, sends)
        return True

    assert run_processes(body, 2, 2) == [[True, True], [True, True]]


def test_a_rank_failure_stops_every_process_and_each_reports_the_root_cause():
    def body():
        rank = threadpar.get_rank()
        threadpar.all_reduce(torch.ones(2))
        if rank == 3:
            raise ValueError("boom on purpose")
        if rank == 0:
            threadpar.recv(torch.empty(1), src=2)  # never sent: only the stop ends this wait
        threadpar.barrier()

    start = time.monotonic()
    outcomes = launch_processes(body, 2, 2, timeout=30)
    assert time.monotonic() - start < 10  # a stop, not the 30 s timeout
    here, there = outcomes[1], outcomes[0]
    assert isinstance(here, threadpar.RankFailedError) and isinstance(here.error, ValueError)
    assert isinstance(there, threadpar.RankFailedError) and there.rank == 3
    assert isinstance(there.error, RemoteRankError)
    assert "rank 3 (process 1) failed with ValueError: boom on purpose" in str(there)
    assert "raise ValueError" in there.traceback_text  # the failing rank's own traceback travels too
    with pytest.raises(ValueError, match="boom on purpose"):
        run_processes(body, 2, 2, timeout=30)


def test_processes_must_launch_the_same_thing():
    outcomes = launch_processes(lambda: None, 2, 2, per_process=lambda p: {"seed": p})
    for outcome in outcomes:
        assert isinstance(outcome, ConfigError)
        assert "launched differently" in str(outcome) and "seed=" in str(outcome)


def test_later_launches_in_the_same_processes_meet_separately():
    store = dist.HashStore()

    def body(value):
        t = torch.tensor([value])
        threadpar.all_reduce(t)
        return t.item()

    first = launch_processes(body, 2, 2, 1.0, store=store)
    second = launch_processes(body, 2, 2, 2.0, store=store)
    assert first == [[4.0, 4.0]] * 2 and second == [[8.0, 8.0]] * 2


def test_threads_per_process_alone_is_the_world_size_of_one_process():
    def body():
        return threadpar.get_rank(), threadpar.get_thread_rank(), threadpar.get_process_rank()

    assert threadpar.launch(body, threads_per_process=3, devices="cpu") == [(0, 0, 0), (1, 1, 0), (2, 2, 0)]


@pytest.mark.parametrize(
    "env,kwargs,match",
    [
        (ProcessEnv(0, 2), {}, "threads_per_process=T"),
        (ProcessEnv(0, 2), {"threads_per_process": 0}, "positive int"),
        (ProcessEnv(0, 2), {"threads_per_process": 2, "world_size": 3}, "2 process"),
    ],
)
def test_bad_process_options_say_what_to_pass(env, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        config = LaunchConfig(devices="cpu", backend="threads", timeout=5, **kwargs)
        launch_in_process(env, lambda: None, (), {}, config)


def test_process_env_reads_torchrun_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert process_env() == ProcessEnv()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT is not set"):
        process_env()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert process_env() == ProcessEnv(3, 4, 1, 2)


def test_default_devices_give_each_process_its_own_gpus():
    assert default_local_devices(8, 4, local_rank=1, local_count=2) == [4, 5, 6, 7]
    assert default_local_devices(2, 2, local_rank=3, local_count=4) == [
        0,
        1,
    ]  # CUDA_VISIBLE_DEVICES per process
    with pytest.raises(ConfigError, match="need 8 GPUs, but this process sees 6"):
        default_local_devices(6, 4, local_rank=0, local_count=2)


def test_message_headers_round_trip():
    header = encode_header(1, 123, 2, 0, -7, torch.bfloat16, (3, 0, 5), 0)
    assert decode_header(header) == (1, 1, 123, 2, 0, -7, torch.bfloat16, [3, 0, 5], 0)
    with pytest.raises(ConfigError, match=f"at most {MAX_DIMS} dimensions"):
        encode_header(0, 1, 0, 1, 0, torch.float32, (1,) * (MAX_DIMS + 1), 4)


def test_a_unique_id_is_made_by_its_creator_and_read_from_the_store_by_everyone_else():
    store, made, got = dist.HashStore(), [], {}
    abort = threadpar.comm.common.abort.AbortSignal()

    def make():
        made.append(1)
        return b"\x01uid\x00" * 16

    def member(m):
        got[m] = shared_unique_id(
            dist.PrefixStore("launch1", store),
            unique_id_key("ab12"),
            m == 0,
            make,
            abort,
            5.0,
            lambda: "late",
        )

    threads = [threading.Thread(target=member, args=(m,)) for m in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [1]  # only the creator (member 0) makes the id
    assert got == {m: b"\x01uid\x00" * 16 for m in range(3)}
    assert dist.PrefixStore("launch1", store).check([unique_id_key("ab12")])
    with pytest.raises(CollectiveTimeoutError, match="member 0 to publish"):
        shared_unique_id(store, "other", False, make, abort, 0.2, lambda: "waited for member 0 to publish")
