"""The offline API's start-up says one short line (issue 41): `llm_ready` with the model, device, KV blocks and
seconds; the ~1,000-character `engine_ready` line is there at debug level, and a server still logs it at info
(tests/server/test_cpu_threads.py reads it from a server's log).

Real processes, as a user runs them: stderr is a pipe here, so lines are JSON (engine/logs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_kernel_cache import seed_cpu_kernels

REPO = Path(__file__).resolve().parents[2]
SHORT_LINE_CHARS = 250  # the engine_ready line is ~1,000

LLM_SCRIPT = """
from engine import LLM, SamplingParams
out = LLM().generate(["Beautiful is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print(out[0].outputs[0].text)
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A private cache folder holding this machine's CPU kernel (so no build line joins the start-up's)."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEKEEPER_LOG_LEVEL"}
    env.update(PYTHONPATH=str(REPO), PAGEKEEPER_CACHE_DIR=str(tmp_path / "cache"))
    seed_cpu_kernels(env)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def _events(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


def _assert_one_short_line(stderr: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert len(lines[0]) < SHORT_LINE_CHARS, lines[0]
    ready = json.loads(lines[0])
    assert ready["event"] == "llm_ready" and ready["level"] == "info"
    assert ready["model"] == "pagekeeper-default" and ready["device"] == "cpu"
    assert isinstance(ready["kv_blocks"], int) and ready["kv_blocks"] > 0
    assert isinstance(ready["seconds"], float) and 0 < ready["seconds"] < 300


def test_engine_generate_logs_one_short_line_at_start_up(env: dict[str, str]) -> None:
    r = _run(["-m", "engine.generate", "Beautiful is", "--max-tokens", "4"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Beautiful is better")
    _assert_one_short_line(r.stderr)


def test_engine_generate_at_debug_also_logs_engine_ready(env: dict[str, str]) -> None:
    r = _run(["-m", "engine.generate", "Beautiful is", "--max-tokens", "4", "--log-level", "debug"], env)
    assert r.returncode == 0, r.stderr
    events = {e["event"]: e for e in _events(r.stderr)}
    assert events["engine_ready"]["level"] == "debug"
    assert {"phases", "num_blocks", "weights_bytes", "load_seconds"} <= set(events["engine_ready"])
    assert events["llm_ready"]["kv_blocks"] == events["engine_ready"]["num_blocks"]


@pytest.mark.parametrize("level", [None, "debug", "warning"])
def test_llm_logs_at_the_level_pagekeeper_log_level_names(env: dict[str, str], level: str | None) -> None:
    if level is not None:
        env["PAGEKEEPER_LOG_LEVEL"] = level
    r = _run(["-c", LLM_SCRIPT], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" better than")
    if level is None:
        _assert_one_short_line(r.stderr)
    elif level == "debug":
        assert {"engine_ready", "llm_ready"} <= {e["event"] for e in _events(r.stderr)}
    else:
        assert r.stderr == ""


def test_an_unknown_log_level_is_one_line_and_exit_2(env: dict[str, str]) -> None:
    env["PAGEKEEPER_LOG_LEVEL"] = "loud"
    r = _run(["-m", "engine.generate", "Beautiful is"], env)
    assert r.returncode == 2
    assert r.stderr == "error: PAGEKEEPER_LOG_LEVEL='loud': not one of debug, info, warning, error\n"
