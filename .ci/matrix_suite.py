"""The suite one test file at a time, each in a pytest of its own, and a table of what happened (.ci/matrix).

    python .ci/matrix_suite.py --logs DIR [TEST_FILE...]      (default: every tests/**/test_*.py)

One file per process, so a crash (a segfault has no Python traceback to fail a test with) ends only its file
and is named in the table with its signal. Each file's output goes to DIR/<file>.log, its JUnit XML to
DIR/<file>.xml; DIR/summary.json holds the rows and the interpreter's and torch's versions. The exit status
is 1 if any file failed, errored, crashed or hung.
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

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def interpreter() -> str:
    gil = "free-threaded" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL"
    return f"CPython {platform.python_version()} ({gil})"


def torch_build() -> str:
    code = "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"
    version, cuda = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return version if cuda == "cpu" else f"{version} (CUDA {cuda} build)"


def read_junit(junit: Path, row: FileOutcome) -> None:
    """passed / failed / errors / skipped and the failing tests' ids, from pytest's JUnit XML."""
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            row.failed += 1
            row.failing.append(test_id)
        elif case.find("error") is not None:
            row.errors += 1
            row.failing.append(test_id)
        elif case.find("skipped") is not None:
            row.skipped += 1
        else:
            row.passed += 1


def run_file(path: Path, logs: Path) -> FileOutcome:
    stem = str(path.with_suffix("")).replace("/", ".")
    junit, log = logs / f"{stem}.xml", logs / f"{stem}.log"
    junit.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        str(path),
    ]
    start = time.monotonic()
    code: int | None
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=FILE_TIMEOUT_S,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code is None:
        outcome = f"hung past {FILE_TIMEOUT_S} s"
    elif code < 0:
        outcome = f"crashed ({signal.Signals(-code).name})"
    elif code in (0, 5):  # 5: no tests collected
        outcome = "ok"
    elif code == 1:
        outcome = "failures"
    else:
        outcome = f"pytest exited with {code}"
    row = FileOutcome(str(path), outcome, round(time.monotonic() - start, 1))
    if junit.exists():  # (a crash leaves none: the file's counts are then unknown)
        read_junit(junit, row)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    files = args.files or sorted(Path("tests").rglob("test_*.py"))
    args.logs.mkdir(parents=True, exist_ok=True)
    head = f"{interpreter()}, torch {torch_build()}"
    print(f"# {head}: {len(files)} test files, one pytest each; logs in {args.logs}", flush=True)
    rows = []
    for path in files:
        row = run_file(path, args.logs)
        rows.append(row)
        print(
            f"{row.file}: {row.outcome}, {row.passed} passed, {row.failed} failed, {row.errors} errors, "
            f"{row.skipped} skipped, {row.seconds} s",
            flush=True,
        )
    total = {k: sum(getattr(r, k) for r in rows) for k in ("passed", "failed", "errors", "skipped")}
    minutes = sum(r.seconds for r in rows) / 60
    bad = [r for r in rows if not r.ok]
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
