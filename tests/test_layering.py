"""The package layering the design depends on, checked on the source (not on what happens to load).

- `engine/runner` takes plans and returns tokens: from `engine.core` it may import only the plan
  type, so that a worker process (tensor parallelism) needs nothing else of the core.
- `engine/` never imports `opsctl/`: the ops kit depends on the engine, not the reverse.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _offenders(package: str, forbidden: str, allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in _imports(path):
            if (name == forbidden or name.startswith(forbidden + ".")) and name not in allowed:
                found.append(f"{path.relative_to(REPO)} imports {name}")
    return found


def test_the_runner_imports_only_the_plan_from_the_core():
    assert _offenders("engine/runner", "engine.core", allowed=("engine.core.plan",)) == []


def test_the_engine_never_imports_the_ops_kit():
    assert _offenders("engine", "opsctl") == []


def test_the_core_and_its_process_never_import_the_server():
    """engine/coreproc/core_main.py runs the core without the HTTP server: nothing below it may reach back up."""
    assert _offenders("engine/core", "engine.server") == []
    assert _offenders("engine/coreproc", "engine.server") == []


def test_a_front_whose_core_runs_in_its_own_process_imports_no_torch():
    """The front stays small so that it is not what dies (issue 38): what it imports to serve, checked in a fresh
    interpreter (engine/coreproc/remote.py, the server's modules, LLMEngine with a remote core)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import engine.server.__main__, engine.server.app, engine.server.openai_api, engine.llm_engine\n"
        "import engine.coreproc.remote, engine.model.tokenizer_load, engine.cpu_threads, engine.core_share\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
