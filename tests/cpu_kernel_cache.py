"""Give a test's fresh cache directory this machine's build of the CPU decode kernel (kernels/cpu_ext.py).

Why: a systemd box (CacheDirectory=, an empty tmpfs) and a Kubernetes pod (an emptyDir) start with no cache, so
every engine they start compiled the extension first: 21 compiles and 273 s of CPU in one run of the suite
(2026-11-26), and 36-40 s of each pod's start in the rolling-update test, on a 2-core machine.  Those tests are
about units, probes and rollouts, not about compiling; building into an empty cache is what every suite's first
CPU engine does (into ~/.cache/pagekeeper) and what tests/kernels/test_cpu_ext.py checks.  The copy keeps the
files' times, so the build's own up-to-date check accepts it, exactly as it accepts a cache that outlived a
restart.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Mapping
from pathlib import Path


@functools.cache
def _this_machines_build() -> Path | None:
    """The build directory of the extension this process loads (built now if need be); None if there is none."""
    from kernels import cpu_ext

    if cpu_ext.mode() == "off" or cpu_ext.unavailable_reason() is not None:
        return None
    return cpu_ext.cache_root() / "cpu-ext" / cpu_ext.build_key()


def seed_cpu_kernels(env: Mapping[str, str]) -> bool:
    """Copy the build to where an engine started with `env` looks for it (kernels.cpu_ext.cache_root); False if this
    machine has no build to copy."""
    from kernels import cpu_ext

    build = _this_machines_build()
    if build is None or not build.is_dir():
        return False
    shutil.copytree(build, cpu_ext.cache_root(env) / "cpu-ext" / build.name, dirs_exist_ok=True)
    return True
