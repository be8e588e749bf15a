"""DESIGN.md: its rules are numbered once, every "DESIGN.md rule N" in the code points at one of them, and the
files its tables name exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "DESIGN.md").read_text()
SOURCES = [p for d in ("threadpar", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")]


def rules() -> dict[int, str]:
    section = DESIGN.split("## The rules", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^(\d+)\. \*\*(.+?)\*\*", section, flags=re.MULTILINE)
    numbers = [int(n) for n, _ in found]
    assert numbers == list(range(1, len(numbers) + 1)), f"rules must be numbered 1..N once: {numbers}"
    return {int(n): title for n, title in found}


def test_every_citation_names_an_existing_rule_in_one_form():
    known = rules()
    cited = {}
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"rule \d+ of DESIGN|DESIGN\.md, rule", text), (
            f"{path}: cite as 'DESIGN.md rule N'"
        )
        for number in re.findall(r"DESIGN\.md rule (\d+)", text):
            cited.setdefault(int(number), []).append(path.name)
    assert cited, "the code cites the design rules"
    unknown = {n: files for n, files in cited.items() if n not in known}
    assert not unknown, f"citations of rules that DESIGN.md does not have: {unknown}"


def test_the_citations_point_at_the_rule_they_mean():
    # The places the issue named, each with the rule its comment explains.
    expected = {
        "threadpar/parallel/tensor_parallel/mappings.py": "thread-local context inside autograd",
        "threadpar/parallel/groups.py": "thread-local context inside autograd",
        "threadpar/parallel/tensor_parallel/random.py": "default RNG",
        "ddp_reference.py": "default RNG",  # tests/ or tests/helpers/
        "threadpar/parallel/data_parallel.py": "process-wide torch settings",
        "threadpar/pipeline/p2p.py": "GIL",
    }
    known = rules()
    for relative, words in expected.items():
        path = ROOT / relative if "/" in relative else next((ROOT / "tests").rglob(relative))
        numbers = {int(n) for n in re.findall(r"DESIGN\.md rule (\d+)", path.read_text())}
        assert len(numbers) == 1, relative
        assert words in known[numbers.pop()], relative


def test_no_code_says_it_relies_on_the_gil_for_atomicity():
    for path in SOURCES:
        if path.name == Path(__file__).name:
            continue
        for line in path.read_text().splitlines():
            lowered = line.lower()
            assert not ("atomic" in lowered and "gil" in lowered and "rule 10" not in lowered), (
                f"{path}: {line}"
            )


def test_the_files_the_design_names_exist_and_the_readme_links_it():
    named = set(re.findall(r"`((?:comm|runtime|parallel|pipeline)/[\w/]+\.py)", DESIGN))
    assert len(named) > 15
    missing = sorted(n for n in named if not (ROOT / "threadpar" / n).exists())
    assert not missing, f"DESIGN.md names files that are not there: {missing}"
    assert "(DESIGN.md)" in (ROOT / "README.md").read_text()
