"""Benchmarks run as a user runs them: `python -m benchmarks.<name>` in a subprocess from the repository root."""

from __future__ import annotations

import subprocess
import sys

from tests.server.harness import REPO


def run_benchmark(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )
