"""Compiled bytecode for the engine's imports where the installation keeps none.

An engine imports about 4 s of Python on a GPU host, most of it torch.  Where torch's modules have no compiled bytecode
beside them and the process may not write any (`PYTHONDONTWRITEBYTECODE`, common in container images, or a read-only
site-packages), every engine start compiles them from source again: `import torch` takes about twice as long
(docs/decisions/bytecode-cache.md).  The supervisor starts an engine at every restart and keeps a spare one, so it gives
its engines and the weights keeper a bytecode folder of their own under the cache folder (`PYTHONPYCACHEPREFIX`), which
only the first start fills.  Nothing is written beside the installation's sources.  `[supervisor] bytecode_cache =
"off"` leaves the environment alone, and so does an operator's own `PYTHONPYCACHEPREFIX`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.cache_dir import cache_root

PROBE_MODULE = "torch"  # the heaviest import on the start path: its bytecode stands for the installation's


@dataclass(frozen=True)
class BytecodePlan:
    env: dict[str, str]  # what the engine's environment gets (empty: nothing changes)
    reason: str  # why, in a few words, for the supervisor's log


def bytecode_plan(env: Mapping[str, str], mode: str = "auto", module: str = PROBE_MODULE) -> BytecodePlan:
    """The environment an engine started with `env` needs so that its imports are compiled at most once."""
    if mode == "off":
        return BytecodePlan({}, "bytecode_cache = off")
    if env.get("PYTHONPYCACHEPREFIX"):
        return BytecodePlan({}, f"PYTHONPYCACHEPREFIX is set ({env['PYTHONPYCACHEPREFIX']})")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return BytecodePlan({}, f"{module} is not installed from Python sources")
    if Path(importlib.util.cache_from_source(spec.origin)).exists():
        return BytecodePlan({}, f"{module} has compiled bytecode beside its sources")
    if env.get("PYTHONDONTWRITEBYTECODE"):
        why = "PYTHONDONTWRITEBYTECODE is set"
    elif not os.access(Path(spec.origin).parent, os.W_OK):
        why = f"{Path(spec.origin).parent} is read-only"
    else:
        return BytecodePlan({}, "the first engine writes bytecode beside the sources")
    folder = cache_root(env) / "bytecode"
    # An empty PYTHONDONTWRITEBYTECODE counts as unset (Python reads it as "a non-empty string disables writing").
    return BytecodePlan(
        {"PYTHONPYCACHEPREFIX": str(folder), "PYTHONDONTWRITEBYTECODE": ""},
        f"{module} has no compiled bytecode and {why}: engines keep theirs in {folder}",
    )
