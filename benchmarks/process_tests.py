"""torch's own DTensor test files, both ways: on processes as torch runs them, and on rank threads under the plugin.

    python -m benchmarks.process_tests ~/.cache/threadpar/torch-tests/2.13.0      # the files of that folder
    python -m benchmarks.process_tests DIR --rounds 3 -k "not compile"               # medians of 3; pytest's -k

The test files are torch's, not threadpar's: take them from pytorch's sources (test/distributed/tensor/...)
into a folder outside this repository (its SOURCES.txt, if any, is printed: which files, from where). Each
round runs `pytest -rA DIR` (torch's harness: a spawned process per rank) and `pytest -p
threadpar.testing.process_tests -rA DIR` (rank threads) in subprocesses, one after the other; it prints the
tests passed each way, every test that passed on processes but not on threads (with its reason), and the
median wall-clock time of each way and their ratio (threads / processes).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

from benchmarks.harness import machine_line, table

OUTCOME = re.compile(r"^(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) (\S+)(?: - (.*))?$")


def run_pytest(folder: str, threads: bool, select: str | None) -> tuple[float, dict[str, str], str]:
    """(wall-clock seconds, test id -> outcome, output) of one pytest run over `folder`."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        folder,
        folder,
    ]
    if threads:
        command[3:3] = ["-p", "threadpar.testing.process_tests"]
    if select:
        command += ["-k", select]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    outcomes: dict[str, str] = {}
    for line in done.stdout.splitlines():
        match = OUTCOME.match(line.strip())
        if match and "::" in match[2]:
            outcomes[match[2].split("/")[-1]] = match[1]
    return seconds, outcomes, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="a folder of torch's test files (kept outside this repository)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("-k", dest="select", default=None, help="pytest's -k expression")
    args = parser.parse_args()
    folder = os.path.abspath(os.path.expanduser(args.folder))
    files = sorted(f for f in os.listdir(folder) if f.startswith("test_") and f.endswith(".py"))
    print(machine_line())
    print(f"torch's test files from {folder}: {', '.join(files)}")
    sources = os.path.join(folder, "SOURCES.txt")
    if os.path.exists(sources):
        print(pathlib.Path(sources).read_text(encoding="utf-8").rstrip())
    times: dict[str, list[float]] = {"processes": [], "threads": []}
    outcomes: dict[str, dict[str, str]] = {}
    outputs: dict[str, str] = {}
    for _ in range(args.rounds):
        for way in ("processes", "threads"):
            seconds, seen, output = run_pytest(folder, way == "threads", args.select)
            times[way].append(seconds)
            outcomes[way], outputs[way] = seen, output
    passed = {way: {t for t, o in seen.items() if o in ("PASSED", "XFAIL")} for way, seen in outcomes.items()}
    both = passed["processes"] & passed["threads"]
    only_processes = sorted(passed["processes"] - passed["threads"])
    median = {way: statistics.median(samples) for way, samples in times.items()}
    rows = [
        [way, len(outcomes[way]), len(passed[way]), f"{median[way]:.1f} s"]
        for way in ("processes", "threads")
    ]
    print(table(["way", "tests", "passed", f"wall time (median of {args.rounds})"], rows))
    print(
        f"passed both ways: {len(both)}; threads / processes wall time: {median['threads'] / median['processes']:.3f}x"
    )
    if only_processes:
        print(f"passed on processes but not on threads ({len(only_processes)}):")
        for test in only_processes:
            print(f"  {test}: {outcomes['threads'].get(test, 'not run')}")
    only_threads = sorted(passed["threads"] - passed["processes"])
    if only_threads:
        print(f"passed on threads but not on processes: {', '.join(only_threads)}")


if __name__ == "__main__":
    main()
