"""The memory summary names the test that raised a peak: here a real child process that touches 300 MB, in a fresh
interpreter (in the suite an earlier, larger child may already hold the peak)."""

from __future__ import annotations

import subprocess
import sys

from tests.server.harness import REPO

SCRIPT = """
import subprocess, sys
from tests.memory_report import PeakRecorder
r = PeakRecorder()
r.after("start")
subprocess.run([sys.executable, "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"], check=True)
r.after("tests/x.py::allocates")
print("\\n".join(r.lines()))
"""


def test_a_child_that_touches_300_mb_is_named_with_its_peak() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120, check=True
    ).stdout
    print(out)
    child = next(line for line in out.splitlines() if line.startswith("peak RSS, largest child process"))
    peak_gb = float(child.split(": ")[1].split(" GB")[0])
    assert 0.3 <= peak_gb < 0.5 and "after tests/x.py::allocates" in child
    assert "over the 2 GB" not in child
    assert any(line.startswith("peak RSS, pytest process") for line in out.splitlines())
