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


LIBRARIES = """
import logging, warnings
from engine.logs import configure_logging
from engine.model.tokenizer_load import load_tokenizer
from engine.config import EngineConfig
configure_logging()
tokenizer = load_tokenizer(EngineConfig())  # transformers configures its own stderr handler on import
tokenizer("Beautiful is better than ugly. " * 200)  # past the checkpoint's 256: the engine refuses, not transformers
logging.getLogger("transformers.tokenization_utils_base").warning("a transformers warning")
warnings.warn("a python warning")
logging.getLogger("uvicorn.error").info("library info stays out")
"""


def test_library_logs_and_warnings_are_json_lines_like_ours(tmp_path: Path) -> None:
    """transformers wrote `[transformers] Token indices sequence length is longer than the specified maximum ...`
    into engine.log: a plain line among JSON ones.  The engine checks lengths itself, so that warning is gone; any
    other library warning and Python warning comes out as one of our JSON lines."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-c", LIBRARIES], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    print("\n".join(lines))
    events = [json.loads(ln) for ln in lines]  # every line is JSON
    assert not any("Token indices sequence length" in e["event"] for e in events)
    found = {e["event"]: e for e in events}
    assert found["a transformers warning"]["level"] == "warning"
    assert found["a transformers warning"]["logger"] == "transformers.tokenization_utils_base"
    assert any("a python warning" in e["event"] and e["logger"] == "py.warnings" for e in events)
    assert "library info stays out" not in r.stderr
