"""The suite, and a table per test file of what happened (.ci/matrix).

    python .ci/matrix_suite.py --logs DIR [--per-file] [TEST_FILE...]   (default: every tests/**/test_*.py)

--per-file runs each file in a pytest of its own, so a crash (a segfault has no Python traceback to fail a
test with) ends only its file and is named in the table with its signal; it costs a torch import per file
(on 2 busy cores, about half an hour more). Without it, one pytest runs them all, as CI does, and the table
comes from its JUnit XML. Output goes to DIR/<file or suite>.log, the JUnit XML beside it; DIR/summary.json
holds the rows and the interpreter's and torch's versions. The exit status is 1 if any file failed,
errored, crashed or hung.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import signal
import subprocess
import sys
import sysconfig
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# A file's own limit: every test already has pytest-timeout's 60 s, so this only stops a hang outside a test.
FILE_TIMEOUT_S = 1800


@dataclasses.dataclass
class FileOutcome:
    file: str
    outcome: str  # ok, failures, crashed (SIGSEGV), hung, pytest exited with N
    seconds: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failing: list[str] = dataclasses.field(default_factory=list)

    def add(self, case: ET.Element) -> None:
        """Count one test case of pytest's JUnit XML."""
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            self.failed += 1
            self.failing.append(test_id)
        elif case.find("error") is not None:
            self.errors += 1
            self.failing.append(test_id)
        elif case.find("skipped") is not None:
            self.skipped += 1
        else:
            self.passed += 1


def interpreter() -> str:
    gil = "free-threaded" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL"
    return f"CPython {platform.python_version()} ({gil})"


def torch_build() -> str:
    code = "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    version, cuda = out.stdout.split()
    return version if cuda == "cpu" else f"{version} (CUDA {cuda} build)"


def run_pytest(paths: list[Path], junit: Path, log: Path, timeout: float) -> tuple[str, float]:
    """(outcome, seconds) of one pytest over `paths`, its output in `log`, its JUnit XML in `junit`."""
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    start = time.monotonic()
    code: int | None
    with log.open("w") as out:
        try:
            done = subprocess.run(
                [*command, *map(str, paths)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.monotonic() - start, 1)
    if code is None:
        return f"hung past {timeout:.0f} s", seconds
    if code < 0:
        return f"crashed ({signal.Signals(-code).name})", seconds
    if code in (0, 5):  # 5: no tests collected
        return "ok", seconds
    return ("failures" if code == 1 else f"pytest exited with {code}"), seconds


def run_file(path: Path, logs: Path) -> FileOutcome:
    stem = str(path.with_suffix("")).replace("/", ".")
    junit = logs / f"{stem}.xml"
    outcome, seconds = run_pytest([path], junit, logs / f"{stem}.log", FILE_TIMEOUT_S)
    row = FileOutcome(str(path), outcome, seconds)
    if junit.exists():  # (a crash leaves none: the file's counts are then unknown)
        for case in ET.parse(junit).getroot().iter("testcase"):
            row.add(case)
    return row


def run_whole(files: list[Path], logs: Path) -> list[FileOutcome]:
    """One pytest for every file; a row per file from the JUnit XML (a test's classname names its module)."""
    junit = logs / "suite.xml"
    outcome, seconds = run_pytest(files, junit, logs / "suite.log", FILE_TIMEOUT_S * 4)
    whole = FileOutcome("(the whole suite, one pytest)", outcome, seconds)
    if not junit.exists():
        return [whole]
    rows = {str(path.with_suffix("")).replace("/", "."): FileOutcome(str(path), "ok", 0.0) for path in files}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        row = next((r for m, r in rows.items() if classname == m or classname.startswith(m + ".")), None)
        if row is not None:
            row.seconds = round(row.seconds + float(case.get("time", 0.0)), 1)
            row.add(case)
            if row.failing:
                row.outcome = "failures"
    # When the run itself ended badly (a crash, a hang), say so beside the rows.
    return [*rows.values(), *([whole] if outcome not in ("ok", "failures") else [])]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--per-file", action="store_true", help="a pytest per test file")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    files = args.files or sorted(Path("tests").rglob("test_*.py"))
    args.logs.mkdir(parents=True, exist_ok=True)
    head = f"{interpreter()}, torch {torch_build()}"
    how = "one pytest each" if args.per_file else "one pytest"
    print(f"# {head}: {len(files)} test files, {how}; logs in {args.logs}", flush=True)
    start = time.monotonic()
    if args.per_file:
        rows = []
        for path in files:
            rows.append(run_file(path, args.logs))
            row = rows[-1]
            print(
                f"{row.file}: {row.outcome}, {row.passed} passed, {row.failed} failed, {row.seconds} s",
                flush=True,
            )
    else:
        rows = run_whole(files, args.logs)
    total = {k: sum(getattr(r, k) for r in rows) for k in ("passed", "failed", "errors", "skipped")}
    minutes = (time.monotonic() - start) / 60
    bad = [r for r in rows if r.outcome != "ok"]
    summary = {"interpreter": interpreter(), "torch": torch_build(), "total": total, "minutes": minutes}
    files_out = [dataclasses.asdict(r) for r in rows]
    (args.logs / "summary.json").write_text(json.dumps({**summary, "files": files_out}, indent=1))
    print(
        f"\n{head}: {total['passed']} passed, {total['failed']} failed, {total['errors']} errors, "
        f"{total['skipped']} skipped in {minutes:.1f} min; files not ok: {len(bad)}"
    )
    for row in bad:
        print(f"  {row.file}: {row.outcome}" + "".join(f"\n    {t}" for t in row.failing))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
