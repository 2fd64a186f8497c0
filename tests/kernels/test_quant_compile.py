"""The quantized-matmul kernels compiled for an H100 (sm_90) on this host, GPU or not.  Triton's interpreter runs
the kernels' arithmetic but not its compiler, which refuses things the interpreter accepts (a plain-float global,
two return types in one jit function: both were caught this way).  Every default tile kernels/quant_cuda.py can
launch is compiled to a cubin (tests/kernels/sm90_compile.py, in a process without the interpreter); registers and
spills are printed, and a spill in a default tile fails (a decode kernel that spills is slower than the bf16
product it replaces)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_every_default_tile_compiles_for_sm90_without_spilling():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/kernels/sm90_compile.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(row)
    from kernels.fp8_gemv import CONFIGS

    assert len(rows) == 3 + 20 + 10 + 8 + 2 + len(CONFIGS) + 1 + 1
    failed = {r["name"]: r["error"] for r in rows if not r["ok"]}
    assert not failed, failed
    spills = {r["name"]: r["stack"] for r in rows if r.get("stack")}
    assert not spills, f"default tiles that spill (bytes of stack): {spills}"
