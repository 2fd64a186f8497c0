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
