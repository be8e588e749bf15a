"""The registry of the CUDA/NCCL double's rules (tests/fakes/rules.py) stays honest: every test it names exists
(resolved by pytest's own collection, parametrized ids included, no test run), every GPU-tier test is marked
`cuda` and every CPU test is not, ids are unique, and a rule without a GPU test says why. It prints the count
issue 38 asks for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.rules import RULES, count_line, covered

ROOT = Path(__file__).resolve().parents[1]


class _Collector:
    """A pytest plugin that keeps each collected item's node id and whether it is marked `cuda`."""

    def __init__(self) -> None:
        self.cuda: dict[str, bool] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.cuda[item.nodeid] = item.get_closest_marker("cuda") is not None


@pytest.fixture(scope="module")
def collected() -> dict[str, bool]:
    """Every item of the files the registry names, as this pytest collects them (in process: no test runs)."""
    files = sorted({test.split("::")[0] for r in RULES for test in (r.cpu_test, r.gpu_test) if test})
    collector = _Collector()
    code = pytest.main(
        [
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(ROOT),
            *(str(ROOT / f) for f in files),
        ],
        plugins=[collector],
    )
    assert code == 0, f"collecting the registry's test files failed (exit {code})"
    return collector.cuda


def _items(node: str, collected: dict[str, bool]) -> list[str]:
    """The collected items a registry node id names: itself, or every parametrization of a bare function."""
    return [n for n in collected if n == node or (n.startswith(node + "[") and "[" not in node)]


def test_rule_ids_are_unique_short_and_each_rule_is_whole():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for r in RULES:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.id) and len(r.id) <= 48, r.id
        assert r.fact and r.where and r.source and r.cpu_test, r.id
        assert (r.gpu_test is None) == bool(r.why_no_gpu_test), (
            f"{r.id}: a rule has a GPU test or says why not (why_no_gpu_test), never both"
        )


def test_every_named_test_exists_and_gpu_ones_alone_are_marked_cuda(collected):
    problems = []
    for r in RULES:
        for node, gpu in ((r.cpu_test, False), (r.gpu_test, True)):
            if node is None:
                continue
            items = _items(node, collected)
            if not items:
                problems.append(f"{r.id}: {node} is not a test pytest collects")
            for item in items:
                if collected[item] != gpu:
                    tier = "GPU" if gpu else "CPU"
                    problems.append(f"{r.id}: {tier} test {item} is {'not ' if gpu else ''}marked cuda")
    assert not problems, "\n".join(problems)


def test_the_count_is_printed(capsys):
    line = count_line()
    assert line == f"double rules with a GPU-tier test of the same fact: {len(covered())}/{len(RULES)}"
    with capsys.disabled():
        print(f"\n{line}")


def test_the_script_prints_the_table_and_the_count():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fakes.rules"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == count_line()
    for r in RULES:
        assert any(line.startswith(r.id + " ") for line in lines), r.id


def test_the_docs_say_todays_count():
    text = (ROOT / "docs" / "testing.md").read_text()
    assert f"today {len(covered())} of the double's {len(RULES)}" in text, (
        "docs/testing.md's count of the double's rules with a GPU test is stale: " + count_line()
    )
