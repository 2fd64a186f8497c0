"""structlog without rich in the engine's and opsctl's processes: each imports structlog first, with rich hidden.

structlog imports rich at its own import when rich is installed, only to offer rich tracebacks in its console
renderer; that import is a good part of every `opsctl` command's start and of the supervisor's before it spawns the
engine (benchmarks/opsctl_start.py, benchmarks/results/opsctl-start-*.json), and about 0.15 CPU-s of each engine
process's start (the server's front and its core).  Our logs never use it: the JSON renderer, what a file or a
journal gets, has no use for it, and our events reach the console renderer with their traceback already formatted
(`format_exc_info` in engine/logs.py).  rich is not one of our dependencies either, so this is also what a terminal
shows where it is not installed.  Only a library's record that carries an exception, shown in a terminal, is printed
as Python's own traceback instead of rich's panel.  colorama, which structlog needs for colors on Windows only, is
left out the same way: its escape codes are structlog's own elsewhere.

Called by opsctl/__init__.py and by the engine's entry points (engine/server/__main__.py, engine/loop/__main__.py),
never on import of the engine's library modules: a program that embeds the engine keeps structlog as it would be.
A process that imported structlog before opsctl (a test, a program that embeds it) keeps what it has.
"""

from __future__ import annotations

import importlib
import sys

HIDDEN = ("rich", "colorama") if sys.platform != "win32" else ("rich",)


def import_structlog_without_rich() -> None:
    if "structlog" in sys.modules:
        return
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import NAME` raises ImportError: "not installed"
    try:
        importlib.import_module("structlog")
    finally:
        for name in hidden:
            del sys.modules[name]  # anyone else may import them later, as usual
