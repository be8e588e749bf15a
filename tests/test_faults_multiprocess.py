"""Faults across real processes: 2 processes x 2 rank threads train a tiny DDP model and one fault is injected.

Every fault runs in a job of its own (benchmarks/faults.py starts the processes, injects the fault and
watches them end); the jobs run side by side, so the suite costs about one job's time, mostly Python and
torch starting. Each test checks one fault: every process gone within BOUND_S of the fault (wide, for a
busy 2-core machine: a stop takes about a second alone), each process's exit code, and that every process
names the right rank, process or signal.
"""

import concurrent.futures
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.faults import Outcome, run_fault

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]

JOBS_AT_ONCE = 3  # 6 processes starting torch at once on 2 cores
BOUND_S = 45.0  # from the fault (a stuck rank: the end of its timeout) to every process gone
SIGINT_CODE, SIGKILL_CODE = -2, -9  # subprocess's codes: killed by that signal
SIGTERM_CODE = 128 + 15  # threadpar.errors.Terminated's exit code


@pytest.fixture(scope="module")
def outcomes():
    """Every fault once, side by side; the kill during a checkpoint save is followed by a resume."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)

        def save_then_resume() -> tuple[Outcome, Outcome, dict]:
            killed = run_fault("save-kill", "env", BOUND_S, directory)
            files = sorted(p.name for p in directory.iterdir())
            checkpoint = torch.load(directory / "checkpoint.pt", weights_only=True)
            resumed = run_fault("resume", "env", BOUND_S, directory)
            return killed, resumed, {"files": files, "checkpoint": checkpoint}

        faults = ("raise", "kill", "sigterm", "sigint", "stuck0", "stuck3", "late23")
        with concurrent.futures.ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
            saving = pool.submit(save_then_resume)
            runs = {f: pool.submit(run_fault, f, "env", BOUND_S) for f in faults}
            results = {f: _outcome(run) for f, run in runs.items()}
            results["save"] = _outcome(saving)
    return results


def _outcome(future: concurrent.futures.Future):
    """The job's outcome, or the exception that ended it (raised again by the test of that fault)."""
    try:
        return future.result()
    except Exception as error:
        return error


def _check(outcome: Outcome | Exception, codes: list[int]) -> None:
    if isinstance(outcome, Exception):
        raise outcome
    shown = "\n".join(
        f"--- process {p}:\n{text[-3000:]}" for p, text in outcome.outputs.items() if p is not None
    )
    assert outcome.after is not None and outcome.after < BOUND_S, f"processes left running\n{shown}"
    assert outcome.codes == codes, shown
    assert outcome.named, f"{outcome.why}\n{shown}"


def test_a_raising_rank_is_named_by_both_processes(outcomes):
    _check(outcomes["raise"], [1, 1])


def test_a_killed_process_is_named_with_its_ranks_by_the_survivor(outcomes):
    _check(outcomes["kill"], [1, SIGKILL_CODE])


def test_sigterm_to_one_process_stops_both_and_each_names_the_signal(outcomes):
    _check(outcomes["sigterm"], [1, SIGTERM_CODE])


def test_sigint_to_one_process_stops_both_and_each_names_the_signal(outcomes):
    _check(outcomes["sigint"], [SIGINT_CODE, 1])


@pytest.mark.parametrize("fault", ["stuck0", "stuck3"])
def test_a_rank_that_stops_calling_collectives_is_named_by_every_process(outcomes, fault):
    _check(outcomes[fault], [1, 1])


def test_a_process_whose_ranks_never_reach_the_first_collective_is_named_at_the_timeout(outcomes):
    """The first collective across processes also connects the group's gloo groups: the waiting process
    names ranks 2 and 3 at threadpar's timeout, not gloo's store timeout later without a name."""
    _check(outcomes["late23"], [1, 1])


def test_a_kill_during_a_checkpoint_save_leaves_the_previous_checkpoint_and_the_run_resumes(outcomes):
    if isinstance(outcomes["save"], Exception):
        raise outcomes["save"]
    killed, resumed, seen = outcomes["save"]
    _check(killed, [SIGKILL_CODE, 1])
    # Whole (the padding of one step throughout) and no older than the kill's step - 1 (a save per step).
    checkpoint = seen["checkpoint"]
    assert checkpoint["step"] >= 2 and bool((checkpoint["padding"] == checkpoint["step"]).all())
    assert seen["files"] in (
        ["checkpoint.pt"],
        ["checkpoint.pt", *[f for f in seen["files"] if f.endswith(".tmp")]],
    )
    assert resumed.codes == [0, 0], resumed.outputs
    for process in (0, 1):
        assert f"process {process}: resumed from step {checkpoint['step']}" in resumed.outputs[process]
        assert f"process {process}: finished" in resumed.outputs[process]
