"""The suite one test file at a time, each in a pytest of its own, and a table of what happened (.ci/matrix).

    python .ci/matrix_suite.py --logs DIR [TEST_FILE...]      (default: every tests/**/test_*.py)

One file per process, so a crash (a segfault has no Python traceback to fail a test with) ends only its file
and is named in the table with its signal. Each file's output goes to DIR/<file>.log, its JUnit XML to
DIR/<file>.xml; DIR/summary.json holds the table's rows and the interpreter's and torch's versions. The exit
status is 1 if any file failed, errored or crashed.
"""

from __future__ import annotations

import argparse
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


def interpreter() -> str:
    gil = "free-threaded" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL"
    return f"CPython {platform.python_version()} ({gil})"


def torch_build() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"],
        capture_output=True,
        text=True,
        check=True,
    )
    version, cuda = out.stdout.split()
    return version if cuda == "cpu" else f"{version} (CUDA {cuda} build)"


def counts(junit: Path) -> dict[str, object]:
    """passed / failed / errors / skipped and the failing tests' ids, from pytest's JUnit XML."""
    failed: list[str] = []
    tally = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            tally["failed"] += 1
            failed.append(test_id)
        elif case.find("error") is not None:
            tally["errors"] += 1
            failed.append(test_id)
        elif case.find("skipped") is not None:
            tally["skipped"] += 1
        else:
            tally["passed"] += 1
    return {**tally, "failing": failed}


def run_file(path: Path, logs: Path) -> dict[str, object]:
    stem = str(path.with_suffix("")).replace("/", ".")
    junit, log = logs / f"{stem}.xml", logs / f"{stem}.log"
    junit.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(path)]
    start = time.monotonic()
    with log.open("w") as out:
        try:
            done = subprocess.run(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=FILE_TIMEOUT_S
            )
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    row: dict[str, object] = {"file": str(path), "seconds": round(time.monotonic() - start, 1), "code": code}
    if code is None:
        row["outcome"] = f"hung past {FILE_TIMEOUT_S} s"
    elif code < 0:
        row["outcome"] = f"crashed ({signal.Signals(-code).name})"
    elif code not in (0, 1, 5):  # 5: no tests collected (a file of helpers)
        row["outcome"] = f"pytest exited with {code}"
    else:
        row["outcome"] = "ok" if code in (0, 5) else "failures"
    if junit.exists():  # (a crash leaves none: the file's counts are then unknown)
        row.update(counts(junit))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
            f"{row['file']}: {row['outcome']}, {row.get('passed', '?')} passed, {row.get('failed', '?')} failed, "
            f"{row.get('errors', '?')} errors, {row.get('skipped', '?')} skipped, {row['seconds']} s",
            flush=True,
        )
    total = {k: sum(int(r.get(k, 0)) for r in rows) for k in ("passed", "failed", "errors", "skipped")}  # type: ignore[call-overload]
    seconds = sum(float(r["seconds"]) for r in rows)  # type: ignore[arg-type]
    bad = [r for r in rows if r["outcome"] != "ok"]
    summary = {"interpreter": interpreter(), "torch": torch_build(), "total": total, "seconds": seconds}
    (args.logs / "summary.json").write_text(json.dumps({**summary, "files": rows}, indent=1))
    print(
        f"\n{head}: {total['passed']} passed, {total['failed']} failed, {total['errors']} errors, "
        f"{total['skipped']} skipped in {seconds / 60:.1f} min; files not ok: {len(bad)}"
    )
    for row in bad:
        failing = row.get("failing") or []
        print(f"  {row['file']}: {row['outcome']}" + "".join(f"\n    {t}" for t in failing))  # type: ignore[union-attr]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
