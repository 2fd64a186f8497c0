"""Where pagekeeper keeps what it computes once and reuses across processes: the CPU kernels' builds, start-up
probes, compiled Python bytecode.  One rule for all of them, readable for another process's environment (the
supervisor asks where its engines will look): `$PAGEKEEPER_CACHE_DIR`, else `$CACHE_DIRECTORY` (systemd's
`CacheDirectory=`, its first entry), else `$XDG_CACHE_HOME/pagekeeper`, else `~/.cache/pagekeeper`.
Torch-free: opsctl imports it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """The cache folder for this process's environment, or for the given one (another process's)."""
    env = os.environ if env is None else env
    for var in ("PAGEKEEPER_CACHE_DIR", "CACHE_DIRECTORY"):
        if env.get(var):
            return Path(env[var].split(":")[0])
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagekeeper"
