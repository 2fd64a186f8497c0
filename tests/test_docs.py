"""The design lives in the repository: docs/architecture.md exists, README links to it, the paths it names exist,
and no tracked file points at the design notes that were kept outside the repository (a clone does not have them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
OUTSIDE_NOTES = b"DESIGN" + b".md"  # spelled in two parts, so that this file does not cite them either


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_cites_the_design_notes_outside_the_repository():
    citing = []
    for path in _tracked_files():
        if path.is_file() and OUTSIDE_NOTES in path.read_bytes():
            citing.append(str(path.relative_to(REPO)))
    assert citing == [], f"these files cite {OUTSIDE_NOTES.decode()}; point them at docs/architecture.md: {citing}"


def test_the_architecture_document_has_its_sections_and_readme_links_to_it():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for section in ("Layers and packages", "Memory", "The request path", "The restart path", "The metric contract"):
        assert f"\n## {section}\n" in text, section
    assert "\n## Conventions\n" in text
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert re.search(r"\]\(docs/architecture\.md\)", readme), "README has no link to docs/architecture.md"


def test_every_path_the_architecture_document_names_exists():
    """A module that moves takes its line in docs/architecture.md with it."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    roots = "engine|kernels|opsctl|tests|docs|alerts|grafana|systemd|deploy|benchmarks|scripts"
    named = set(re.findall(rf"`((?:{roots})/[\w./-]*)`", text))
    assert len(named) > 20  # the document names the modules of both paths
    missing = sorted(p for p in named if not (REPO / p.rstrip("/")).exists())
    assert missing == []


def _package_sources() -> list[Path]:
    return [p for pkg in ("engine", "kernels", "opsctl") for p in sorted((REPO / pkg).rglob("*.py"))]


def test_no_dated_measurement_sits_in_the_packages_source():
    """Dated measurements go to docs/decisions/ (the decision, its command and its results file): a docstring keeps
    one line of the reason and the link, and stays true when the next machine gives other numbers."""
    dated = []
    for path in _package_sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\b20\d\d-\d\d-\d\d", line):
                dated.append(f"{path.relative_to(REPO)}:{n}")
    assert dated == []


def test_every_decision_the_code_links_to_exists_and_says_how_to_repeat_it():
    linked = set()
    for path in _package_sources():
        linked |= set(re.findall(r"docs/decisions/([\w-]+\.md)", path.read_text(encoding="utf-8")))
    assert len(linked) >= 10
    for name in sorted(linked):
        text = (REPO / "docs" / "decisions" / name).read_text(encoding="utf-8")
        assert "## Decision" in text and "## Measurement" in text and "## Command and results" in text, name
    index = (REPO / "docs" / "decisions" / "README.md").read_text(encoding="utf-8")
    assert sorted(linked) == sorted(set(re.findall(r"\]\(([\w-]+\.md)\)", index)) & linked)
