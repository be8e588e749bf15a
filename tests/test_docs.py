"""Every ```python block in README.md and docs/*.md runs, as a reader would paste it, on CPU threads.

A block that cannot run here (it needs GPUs, torchrun's processes, or code of the reader's own) is preceded
by the line `<!-- no-run: reason -->`. Such a block is still compiled, and NO_RUN below counts them page by
page, so adding one means saying so here: none is skipped silently. The pages' links to files must resolve,
and the index must list every page.
"""

import importlib
import re
from pathlib import Path

import pytest

import threadpar
from threadpar.runtime import devices as devices_module

launch_module = importlib.import_module(
    "threadpar.runtime.launch"
)  # the package exports a function of that name
ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"^<!-- no-run: (\S.*?) -->$")
# Blocks marked no-run, per page. A change here is a decision: say why in the block's annotation.
NO_RUN_COUNTS = {"docs/gpu.md": 1, "docs/processes-and-torchrun.md": 1}
# Fence languages a page may use; `python` blocks run, the others are shell commands or printed output.
LANGUAGES = {"python", "bash", ""}


def _blocks():
    """(page, line, language, code, no-run reason or None) for every fenced block of every page."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            marker = NO_RUN.match(before)
            name = page.relative_to(ROOT).as_posix()
            found.append((name, line, match.group(1), match.group(2), marker.group(1) if marker else None))
    return found


BLOCKS = _blocks()
RUNNABLE = [
    (page, line, code) for page, line, language, code, reason in BLOCKS if language == "python" and not reason
]


def test_the_pages_have_blocks_and_use_known_fence_languages():
    assert len(RUNNABLE) >= 10, "the docs show runnable code"
    odd = [(page, line, language) for page, line, language, _, _ in BLOCKS if language not in LANGUAGES]
    assert not odd, f"fences the docs test would not run (use ```python, ```bash, or a bare fence): {odd}"


def test_no_run_blocks_are_declared_and_still_compile():
    counts = {}
    for page, line, language, code, reason in BLOCKS:
        if reason is None:
            continue
        assert language == "python", f"{page}:{line}: a no-run annotation before a {language or 'bare'} block"
        compile(code, f"{page}:{line}", "exec")  # a block that is not run must at least be valid Python
        counts[page] = counts.get(page, 0) + 1
    assert counts == NO_RUN_COUNTS, (
        "blocks marked no-run changed: update NO_RUN_COUNTS (and say why in the block)"
    )
    for page in PAGES:
        text = page.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if "no-run" in line and line.strip().startswith("<!--"):
                assert NO_RUN.match(line.strip()), (
                    f"{page.name}:{number}: write it as <!-- no-run: reason -->"
                )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("page", "line", "code"), RUNNABLE, ids=[f"{p}:{n}" for p, n, _ in RUNNABLE])
def test_the_python_block_runs(page, line, code, monkeypatch, tmp_path):
    # On CPU threads, as on a machine without GPUs, even where there are some: the blocks' sizes are small.
    monkeypatch.setattr(devices_module, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(launch_module, "cuda_device_count", lambda: 0)
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__docs__"})


def test_the_links_between_pages_resolve_and_the_index_lists_every_page():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), (
                f"{page.relative_to(ROOT)} links to {target}, which is not there"
            )
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in PAGES if p.parent == ROOT / "docs" and p.name != "index.md"]
    unlisted = [name for name in pages if f"]({name})" not in index]
    assert not unlisted, f"docs/index.md does not list {unlisted}"
    assert "](docs/index.md)" in (ROOT / "README.md").read_text()


def test_the_api_page_names_every_launch_option():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in threadpar.LaunchConfig.option_names() if f"{name}=" not in api]
    assert not missing, f"docs/api.md does not name the launch options {missing}"


def test_the_readme_is_a_front_door_with_the_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12_000, (
        "README.md is the front door (a screen or two): move detail into docs/"
    )
    ci_command = 'pip install -e ".[test]" && pytest'
    assert ci_command in (ROOT / ".ci" / "run").read_text() and ci_command in readme
