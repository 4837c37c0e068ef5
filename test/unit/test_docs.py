"""The README and docs/ stay a manual: the README short, no test counts or run timings anywhere,
every result file and relative link they name exists, and CI runs the README's test command."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
TEST_COMMAND = "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q"
MAX_README_LINES = 300


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the details belong in docs/"


def test_no_test_counts_or_run_timings():
    pattern = re.compile(r"\b\d+ (passed|failed|skipped)\b|\bpassed in\b|\bCI (run|time)s? (of|in|took)\b",
                         re.I)
    found = [f"{page.relative_to(REPO)}:{n}: {line.strip()}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "test counts or timings (CI and git keep those):\n" + "\n".join(found)


def test_named_result_files_exist():
    missing = []
    for page in PAGES:
        for name in re.findall(r"`([\w./-]+\.(?:json|txt|log))`", page.read_text()):
            candidates = [REPO / name, REPO / "benchmarks" / "results" / name, REPO / "benchmarks" / name]
            if not any(c.is_file() for c in candidates):
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "named files that do not exist:\n" + "\n".join(missing)


def test_named_source_files_exist():
    """A file of the repository named in backquotes (`robot/scale.py`, `config/lingbot_map.yaml`) exists."""
    missing = []
    for page in PAGES:
        for name in re.findall(r"`([\w./-]+\.(?:py|sh|xml|yaml|rviz|cu|md))`", page.read_text()):
            candidates = [REPO / name, REPO / "lingbot_map_ros" / name, REPO / "benchmarks" / name, page.parent / name]
            if not any(c.exists() for c in candidates):
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "named files that do not exist:\n" + "\n".join(missing)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+ (.+)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = page if not path else page.parent / path
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in README.read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == TEST_COMMAND, ci[-1]
