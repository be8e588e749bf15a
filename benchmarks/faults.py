"""Faults across processes, injected as a user meets them: how long until every process is gone, and who is named.

    python -m benchmarks.faults                          # 5 trials of each fault, under torchrun and plain
    python -m benchmarks.faults --trials 3 --launcher env

Each trial starts a job of 2 processes x 2 rank threads training a tiny DDP model (tests/procs/faults.py),
injects one fault mid-training and measures the time from the fault to the moment every process of the
job (torchrun's agent and workers, or the plain env:// processes) has exited. For a stuck rank the time is
counted from the end of its launch's timeout (STUCK_TIMEOUT_S after the fault). "named" says whether
every process that printed an error (or its signal line) named the right rank, process or signal; the
exit codes are as the launcher reports them (negative: killed by that signal).

The launchers: `torchrun` (torch.distributed.run --standalone, --tee 3 so each line carries its process)
and `env` (two plain Python processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, process 0
hosting the store). tests/test_faults_multiprocess.py runs one trial of each fault through `run_fault`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import free_port
from threadpar.runtime.peer_processes import process_alive

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "procs" / "faults.py"
STUCK_TIMEOUT_S = (
    10.0  # the stuck scenarios' launch timeout: above the steps' skew on a loaded 2-core machine
)
START_S = 300.0  # how long a job may take to reach its fault (Python and torch starting on a busy machine)
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


_ports_lock = threading.Lock()
_ports_given: set[int] = set()  # guarded by _ports_lock: jobs run side by side (the tests' thread pool)


def job_port() -> int:
    """A free port for a job's store that no other job of this driver got (free_port() alone can hand
    two jobs started together the same port, and their processes would meet in one store)."""
    with _ports_lock:
        port = free_port()
        while port in _ports_given:
            port = free_port()
        _ports_given.add(port)
        return port


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env["FAULTS_STUCK_TIMEOUT"] = str(STUCK_TIMEOUT_S)
    env.update(extra)
    return env


# A child exec'd while SIGINT is ignored keeps ignoring it (exec resets handlers, not SIG_IGN), and Python then
# installs no KeyboardInterrupt handler: under a background runner (nohup, `cmd &`: SIGINT ignored) the SIGINT
# faults would time out. So such a child starts through this, which sets SIGINT to its default and execs the
# command (from any thread: signal.signal in the parent is the main thread's only, and preexec_fn is unsafe with
# threads, the fault runs being several at once).
_SIGINT_DEFAULT_THEN_EXEC = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"


def _with_sigint_default(command: list[str]) -> list[str]:
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return command
    return [sys.executable, "-c", _SIGINT_DEFAULT_THEN_EXEC, *command]


class Job:
    """2 processes of tests/procs/faults.py running `scenario`, their output lines read as they come."""

    def __init__(self, scenario: str, launcher: str, directory: Path | None = None) -> None:
        self.launcher = launcher
        args = [str(SCRIPT), scenario] + ([str(directory)] if directory is not None else [])
        self._lines: list[tuple[int | None, str]] = []  # (process or None for the agent's own, text)
        self._seen = threading.Condition()
        self.procs: list[subprocess.Popen] = []
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            # its own session: Ctrl-C at a terminal reaches the agent and its workers (a process group)
            self.procs.append(self._popen([*command, "--tee", "3", *args], child_env(), new_session=True))
        elif launcher == "env":
            port = str(job_port())
            for r in (0, 1):
                env = child_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                self.procs.append(self._popen([sys.executable, *args], env))
        else:
            raise ValueError(f"launcher {launcher!r}: torchrun or env")

    def _popen(self, command: list[str], env: dict[str, str], new_session: bool = False) -> subprocess.Popen:
        index = len(self.procs)
        proc = subprocess.Popen(
            _with_sigint_default(command),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=new_session,
        )
        threading.Thread(target=self._read, args=(proc, index), daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen, index: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            process: int | None = index if self.launcher == "env" else None
            prefixed = re.match(r"\[default(\d+)\]:(.*)", line.rstrip("\n"))
            if prefixed:
                process, line = int(prefixed[1]), prefixed[2]
            with self._seen:
                self._lines.append((process, line.rstrip("\n")))
                self._seen.notify_all()

    # what the processes said ------------------------------------------------------------------------------------
    def output(self, process: int | None = None) -> str:
        """Everything process `process` printed (None: everything, the agent's lines too)."""
        with self._seen:
            return "\n".join(t for p, t in self._lines if process is None or p == process)

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for _, text in self._lines:
                    found = re.search(pattern, text)
                    if found:
                        return found
                remaining = deadline - time.monotonic()
                if remaining <= 0 or all(p.poll() is not None for p in self.procs):
                    raise TimeoutError(
                        f"no line matching {pattern!r} within {timeout:g} s:\n{self.output()[-4000:]}"
                    )
                self._seen.wait(min(remaining, 0.1))

    def pid(self, process: int) -> int:
        return int(self.wait_line(rf"^process {process}: pid (\d+)", START_S)[1])

    # signals and ends -------------------------------------------------------------------------------------------
    def signal_process(self, process: int, sig: signal.Signals) -> float:
        """Send `sig` to worker `process`; returns when (time.monotonic())."""
        pid = self.pid(process)
        os.kill(pid, sig)
        return time.monotonic()

    def signal_launcher(self, sig: signal.Signals, group: bool = False) -> float:
        """Send `sig` to the torchrun agent (or, `group`, to its whole process group as a terminal would)."""
        agent = self.procs[0]
        if group:
            os.killpg(agent.pid, sig)
        else:
            agent.send_signal(sig)
        return time.monotonic()

    def _worker_pids(self) -> list[int]:
        with self._seen:
            return [int(m[1]) for _, t in self._lines if (m := re.match(r"process \d+: pid (\d+)", t))]

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs) and not any(
            process_alive(pid) for pid in self._worker_pids()
        )

    def wait_exited(self, bound: float) -> float | None:
        """When (time.monotonic()) every process was seen gone, or None if some were left after `bound`
        seconds (they are then killed)."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if self.all_exited():
                return time.monotonic()
            time.sleep(0.01)
        self.kill()
        return None

    def kill(self) -> None:
        for pid in self._worker_pids():
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def codes(self) -> list[int | None]:
        return [p.wait(5) for p in self.procs]


@dataclass
class Outcome:
    fault: str
    launcher: str
    after: float | None  # seconds from the fault (a stuck rank: its timeout) to every process gone
    codes: list[int | None]  # the launcher's (torchrun) or each process's exit code
    named: bool
    why: str = ""  # what was not named right
    outputs: dict[int | None, str] = field(default_factory=dict)


def _named_everywhere(job: Job, processes: tuple[int, ...], accept: Callable[[str], bool]) -> str:
    """'' if every process in `processes` printed something `accept`s, else which did not."""
    wrong = [p for p in processes if not accept(job.output(p))]
    return "" if not wrong else f"processes {wrong} did not name it"


def _stuck_named(rank: int, process: int) -> Callable[[str], bool]:
    others = [r for r in range(4) if r != rank]

    def accept(text: str) -> bool:
        named = (
            f"ranks [{rank}] did not arrive" in text
            or f"rank {rank} (process {process}) did not arrive" in text
        )
        wrong = any(
            f"ranks [{r}] did not arrive" in text or f"rank {r} (process {r // 2}) did not arrive" in text
            for r in others
        )
        return named and not wrong and "global ranks [0, 1, 2, 3]" in text and "all_reduce" in text

    return accept


FAULTS = ("raise", "kill", "sigterm", "sigint", "stuck0", "stuck3", "late23", "save-kill")


def run_fault(fault: str, launcher: str, bound: float = 60.0, directory: Path | None = None) -> Outcome:
    """One trial of `fault` under `launcher`; every process is killed `bound` seconds after the fault.
    A job whose store could not listen on its port (taken by another program between free_port() and
    process 0's bind, seconds later) is started once more on another port."""
    try:
        return _run_fault(fault, launcher, bound, directory)
    except TimeoutError as error:
        if "address already in use" not in str(error).lower():
            raise
        return _run_fault(fault, launcher, bound, directory)


def _run_fault(fault: str, launcher: str, bound: float, directory: Path | None) -> Outcome:
    named = {
        "raise": "raise",
        "stuck0": "stuck0",
        "stuck3": "stuck3",
        "late23": "late23",
        "save-kill": "save",
        "resume": "resume",
    }
    scenario = named.get(fault, "train")
    if scenario in ("save", "resume") and directory is None:
        raise ValueError(f"{fault} needs a directory for its checkpoints")
    job = Job(scenario, launcher, directory)
    try:
        why = ""
        if fault == "resume":  # no fault: a run that resumes from a checkpoint and finishes
            when = time.monotonic()
        elif fault in ("raise", "stuck0", "stuck3", "late23"):
            job.wait_line(r"^process \d: FAULT", START_S)
            when = time.monotonic() + (0.0 if fault == "raise" else STUCK_TIMEOUT_S)
        elif fault == "save-kill":
            job.wait_line(r"^process 0: saving step 3", START_S)
            when = job.signal_process(0, signal.SIGKILL)
        else:
            job.wait_line(r"^process 1: step 3", START_S)
            sig = {"kill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}[fault]
            if launcher == "torchrun" and fault == "sigterm":
                when = job.signal_launcher(sig)  # torchrun forwards it to every worker
            elif launcher == "torchrun" and fault == "sigint":
                when = job.signal_launcher(sig, group=True)  # Ctrl-C at the terminal
            else:  # kill -9 of process 1; SIGTERM to process 1 alone; SIGINT to process 0 alone
                when = job.signal_process(0 if fault == "sigint" else 1, sig)
        end = job.wait_exited(bound)
        after = None if end is None else max(0.0, end - when)
        codes = job.codes()
        if fault == "raise":
            why = _named_everywhere(job, (0, 1), lambda t: "rank 3" in t and "ValueError: rank 3 fails" in t)
        elif fault.startswith("stuck"):
            rank = int(fault[-1])
            why = _named_everywhere(job, (0, 1), _stuck_named(rank, rank // 2))
        elif fault == "late23":  # the whole of process 1 never reaches the group's first collective
            why = _named_everywhere(
                job, (0, 1), lambda t: "rank 2 (process 1), rank 3 (process 1) did not arrive" in t
            )
        elif fault in ("kill", "save-kill"):
            victim = 1 if fault == "kill" else 0
            survivor = 1 - victim
            ranks = [2 * victim, 2 * victim + 1]
            why = _named_everywhere(
                job, (survivor,), lambda t: f"process {victim} (ranks {ranks}" in t and "is gone" in t
            )
        elif fault == "sigterm":
            if launcher == "torchrun":
                why = _named_everywhere(job, (0, 1), lambda t: "received SIGTERM" in t)
            else:
                why = _named_everywhere(job, (1,), lambda t: "process 1 of 2 received SIGTERM" in t)
                why += _named_everywhere(
                    job, (0,), lambda t: "process 1 (ranks [2, 3]) received SIGTERM" in t
                )
        elif fault == "sigint":
            if launcher == "torchrun":
                why = _named_everywhere(job, (0, 1), lambda t: "received SIGINT" in t)
            else:
                why = _named_everywhere(job, (0,), lambda t: "process 0 of 2 received SIGINT" in t)
                why += _named_everywhere(job, (1,), lambda t: "process 0 (ranks [0, 1]) received SIGINT" in t)
        outputs = {p: job.output(p) for p in (None, 0, 1)}
        return Outcome(fault, launcher, after, codes, named=not why, why=why, outputs=outputs)
    finally:
        job.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--launcher", choices=("torchrun", "env", "both"), default="both")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of " + ", ".join(FAULTS))
    args = parser.parse_args()
    launchers = ("torchrun", "env") if args.launcher == "both" else (args.launcher,)
    print(f"{args.trials} trials of each fault; 2 processes x 2 rank threads; {os.cpu_count()} cores")
    print("| fault | launcher | everything exited | after the fault (median, min-max) | named | exit codes |")
    print("|---|---|---|---|---|---|")
    for fault in args.faults.split(","):
        for launcher in launchers:
            outcomes, missed = [], 0
            for _ in range(args.trials):
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        outcomes.append(run_fault(fault, launcher, directory=Path(tmp)))
                    except TimeoutError as error:  # it ended before the fault (e.g. a timeout under load)
                        missed += 1
                        print(f"    no fault injected: {str(error)[-300:]}", file=sys.stderr)
            times = [o.after for o in outcomes if o.after is not None]
            exited = f"{len(times)}/{len(outcomes)}" + (
                f" ({missed} ended before the fault)" if missed else ""
            )
            spread = f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f})" if times else "-"
            named = f"{sum(o.named for o in outcomes)}/{len(outcomes)}"
            codes = sorted({str(o.codes) for o in outcomes})
            print(f"| {fault} | {launcher} | {exited} | {spread} | {named} | {' '.join(codes)} |", flush=True)
            for o in outcomes:
                if not o.named:
                    print(f"    not named: {o.why}", file=sys.stderr)


if __name__ == "__main__":
    main()
