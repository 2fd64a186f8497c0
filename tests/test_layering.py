"""The package layering the design depends on, checked on the source (not on what happens to load).

- `LAYERS` is the order of the packages, from the bottom up (docs/architecture.md, "Layers and packages"): a
  module imports its own layer and the layers below it, never one above, so no two packages import each other
  (no package cycle either).  Every import counts, at module level, inside a function and under `if TYPE_CHECKING:`.
- The core and the engine loop keep plain numbers: nothing they can import brings in prometheus_client.
- `engine/runner` takes plans and returns tokens: from `engine.core` it may import only the plan
  module (the contract between the two), so that a worker process (tensor parallelism) needs nothing else of
  the core.
- `engine/` never imports `opsctl/`: the ops kit depends on the engine, not the reverse.
"""

from __future__ import annotations

import ast
import functools
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


# The layers, bottom first; each is a package or a group of engine's root modules.  A new module or package goes
# into the lowest layer it can (test_every_module_has_a_layer says where one is missing).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # flags and their checks, request and output types, plain stats, logging, the process's lifecycle, host tuning
    (
        "engine's foundation",
        (
            "engine/config.py",
            "engine/hub.py",
            "engine/schema.py",
            "engine/default_model",
            "engine/cache_dir.py",
            "engine/logs.py",
            "engine/lean_imports.py",
            "engine/lifecycle.py",
            "engine/sampling_params.py",
            "engine/outputs.py",
            "engine/generation_defaults.py",
            "engine/bad_words.py",
            "engine/structured_output.py",
            "engine/chat.py",
            "engine/stats.py",
            "engine/gc_heap.py",
            "engine/openmp_waits.py",
            "engine/cpu_threads.py",
            "engine/core_share.py",
        ),
    ),
    # what the engine and opsctl agree on: the control socket's client, the in-flight file, sockets, keys
    ("the engine-ops contract", ("engine/ops_contract",)),
    ("kernels", ("kernels",)),
    ("the tensor-parallel group", ("engine/parallel",)),
    ("models", ("engine/model",)),
    ("the KV blocks", ("engine/kv",)),
    ("the memory plan", ("engine/memory",)),
    ("the weights keeper", ("engine/keeper",)),
    # the scheduler and the step loop, in token ids; it drives a runner through the contract in engine/core/plan.py
    ("the core", ("engine/core",)),
    ("the runner", ("engine/runner",)),
    ("tensor-parallel ranks", ("engine/distributed",)),
    # the engine loop's room: the client the front drives (LLMEngine, a core in this process or in its own), the
    # core's process, the output processor and the async bridge the HTTP server talks to
    ("the engine loop", ("engine/loop",)),
    # the public API: `LLM`, generate (engine/__init__.py names its exports as strings, the highest of them engine.llm)
    ("engine's front", ("engine/__init__.py", "engine/llm.py", "engine/generate.py")),
    ("the HTTP server", ("engine/server",)),
    ("the ops kit", ("opsctl",)),
)


def _unit(path: Path) -> str | None:
    """The LAYERS entry `path` (a file of the repository) belongs to."""
    rel = path.relative_to(REPO).as_posix()
    for _, units in LAYERS:
        for unit in units:
            if rel == unit or rel.startswith(unit + "/"):
                return unit
    return None


def _layer_of() -> dict[str, int]:
    return {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def _module_file(name: str) -> Path | None:
    """The file of module `name` in this repository (an attribute's name resolves to its module)."""
    parts = name.split(".")
    while parts:
        base = REPO.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        parts.pop()
    return None


@functools.cache
def _every_import(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in `path`: module level, in functions and under TYPE_CHECKING alike."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from engine import llm` imports the module engine.llm
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def _package_imports() -> list[tuple[str, str, str, str]]:
    """(importer unit, imported unit, importer path:line, module) for every import from one unit into another."""
    edges = []
    for top in ("engine", "kernels", "opsctl"):
        for path in sorted((REPO / top).rglob("*.py")):
            src = _unit(path)
            for line, name in _every_import(path):
                target = _module_file(name)
                dst = _unit(target) if target is not None else None
                if src is not None and dst is not None and dst != src:
                    edges.append((src, dst, f"{path.relative_to(REPO)}:{line}", name))
    return edges


def test_every_module_has_a_layer():
    modules = [p for top in ("engine", "kernels", "opsctl") for p in (REPO / top).rglob("*.py")]
    assert [str(p.relative_to(REPO)) for p in modules if _unit(p) is None] == []
    units = [unit for _, layer in LAYERS for unit in layer]
    assert [u for u in units if not (REPO / u).exists()] == []
    assert len(units) == len(set(units))


def test_no_import_runs_back_up_the_layers():
    layer = _layer_of()
    upward = [
        f"{where} imports {name}: {LAYERS[layer[src]][0]} is below {LAYERS[layer[dst]][0]}"
        for src, dst, where, name in _package_imports()
        if layer[dst] > layer[src]
    ]
    hint = "imports that run back up (move the shared type down, or hand the object in):\n"
    assert upward == [], hint + "\n".join(upward)


def test_no_package_cycle():
    """No two packages (or groups of root modules) reach each other through their imports, whatever the order says."""
    layer = _layer_of()
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in _package_imports():
        if layer[src] != layer[dst]:
            graph.setdefault(LAYERS[layer[src]][0], set()).add(LAYERS[layer[dst]][0])

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cyclic = sorted(unit for unit in graph if unit in reach(unit))
    assert cyclic == [], f"layers on an import cycle: {cyclic}"


def _reachable(starts: list[Path]) -> set[Path]:
    """Every module of the repository that importing `starts` can import, at any depth and by any import."""
    seen: set[Path] = set()
    todo = list(starts)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [f for _, name in _every_import(path) if (f := _module_file(name)) is not None]
    return seen


def _offenders_in(paths: set[Path], forbidden: str) -> list[str]:
    return sorted(
        f"{path.relative_to(REPO)} imports {name}"
        for path in paths
        for _, name in _every_import(path)
        if name == forbidden or name.startswith(forbidden + ".")
    )


def test_the_core_and_the_engine_loop_reach_no_prometheus():
    """Prometheus is the HTTP server's (engine/server/metrics.py): the core and the engine loop keep plain numbers
    (engine/stats.py; the async bridge reports to an observer the server hands it), and nothing they can import
    brings prometheus_client in."""
    starts = [*sorted((REPO / "engine/loop").glob("*.py")), *sorted((REPO / "engine/core").glob("*.py"))]
    assert _offenders_in(_reachable(starts), "prometheus_client") == []


def test_the_runner_imports_only_the_plan_from_the_core():
    assert _offenders("engine/runner", "engine.core", allowed=("engine.core.plan",)) == []


def test_the_engine_never_imports_the_ops_kit():
    assert _offenders("engine", "opsctl") == []


def test_the_core_and_the_engine_loop_never_import_the_server():
    """engine/loop/core_main.py runs the core without the HTTP server, and the loop's bridge is the server's to
    drive: nothing below the server may reach back up."""
    assert _offenders("engine/core", "engine.server") == []
    assert _offenders("engine/loop", "engine.server") == []


def test_a_front_whose_core_runs_in_its_own_process_imports_no_torch():
    """The front stays small so that it is not what dies (issue 38): what it imports to serve, checked in a fresh
    interpreter (engine/loop/remote.py, the server's modules, LLMEngine with a remote core)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import engine.server.__main__, engine.server.app, engine.server.openai_api, engine.loop.llm_engine\n"
        "import engine.loop.remote, engine.model.tokenizer_load, engine.cpu_threads, engine.core_share\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
