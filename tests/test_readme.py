"""README is a newcomer's page (issue 41): short, its links lead somewhere, and its test command is the one CI runs.

The reference material lives in docs/; a link that no longer resolves (a file renamed, a section retitled) is a
dead end for the reader, so every relative link of README.md and docs/*.md must name an existing file and, where it
names a section of a markdown file, an existing heading.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MAX_README_LINES = 200
CI_TEST_COMMAND = "scripts/setup.sh --test && scripts/lint.sh && python3 -m pytest -n 3 --dist loadfile"
CI_SOAK_COMMAND = "python3 -m pytest -m soak"  # the ten-minute soak, which the test command leaves out

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images too
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # links inside code are not links


def _documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = CODE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M)}


def _links(path: Path) -> list[str]:
    return LINK.findall(CODE.sub("", path.read_text(encoding="utf-8")))


def test_readme_is_at_most_200_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; reference material goes to docs/"


def test_every_relative_link_of_readme_and_docs_resolves():
    dead = []
    checked = 0
    for doc in _documents():
        for target in _links(doc):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            checked += 1
            path_part, _, anchor = target.partition("#")
            resolved = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(REPO)}: {target}"
            if not resolved.exists():
                dead.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                dead.append(f"{where} (no such section)")
    assert checked > 50  # README and the docs link each other and the results files
    assert dead == []


def test_the_link_check_finds_a_dead_link_and_a_dead_section(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n## A section: here\n\n[a](#a-section-here) [b](missing.md) [c](#gone) `[d](x.md)`\n")
    assert _anchors(doc) == {"title", "a-section-here"}
    assert _links(doc) == ["#a-section-here", "missing.md", "#gone"]


def test_ci_runs_readmes_test_command_then_its_soak_command():
    """.ci/run takes the line after the `<!-- test-command -->` marker, then the one after `<!-- soak-command -->`;
    they must be the commands README shows, run in that order."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for var, wanted in (("test_cmd", CI_TEST_COMMAND), ("soak_cmd", CI_SOAK_COMMAND)):
        extract = re.search(rf"^{var}=\$\((.*)\)$", ci, re.M)
        assert extract, f".ci/run no longer extracts README's {var}"
        out = subprocess.run(["bash", "-c", extract.group(1)], cwd=REPO, capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == wanted
        assert f'bash -c "${var}"' in ci
    assert ci.index('bash -c "$test_cmd"') < ci.index('bash -c "$soak_cmd"')
