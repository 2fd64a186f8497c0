"""The engine's JSON log lines stay whole when two engines append to one file (the launcher's handover)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINES = 5000

WRITER = """
import sys
from engine.logs import configure_logging
import structlog
configure_logging()
log = structlog.get_logger()
for i in range({lines}):
    log.info("handover_line", writer=sys.argv[1], i=i, pad="x" * 80)
"""


def test_two_unbuffered_engines_appending_to_one_log_never_share_a_line(tmp_path: Path) -> None:
    # as the launcher runs them: PYTHONUNBUFFERED=1, stderr onto one file opened for appending
    path = tmp_path / "engine.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    code = WRITER.format(lines=LINES)
    with open(path, "ab") as out:
        procs = [
            subprocess.Popen([sys.executable, "-c", code, name], stdout=out, stderr=out, env=env)
            for name in ("old", "new")
        ]
        assert [p.wait(120) for p in procs] == [0, 0]
    lines = path.read_text().splitlines()
    parsed, broken = [], []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            broken.append(line)
    per_writer = {w: sum(1 for e in parsed if e["writer"] == w) for w in ("old", "new")}
    print(f"two writers, {LINES} lines each: {len(lines)} lines in the file, {len(broken)} broken, {per_writer}")
    assert not broken, broken[:3]
    assert per_writer == {"old": LINES, "new": LINES}
