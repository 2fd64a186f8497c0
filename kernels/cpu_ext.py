"""The CPU extension (kernels/csrc/): built for this host on first use, then loaded from a cache.

Why compiled: decode attention on a CPU is bound by memory traffic, and torch offers no attention that reads a
paged cache in place; the torch path copies every sequence's blocks once per layer first (kernels/cpu_backend.py).
The decoder layer's small operations (RMSNorm with its residual add, SiLU-and-multiply, rotary, the KV write) are
one pass each here, where torch runs each as five to ten dispatched operations (kernels/cpu_fused.py); and a
float32 linear layer of few rows reads its weight once at stream speed (kernels/cpu_linear.py).
Why built here rather than shipped: ``-march=native`` vectorizes the kernel for the cores it runs on (AVX-512 on
one machine, AVX2 on the next), and torch's own build machinery (``torch.utils.cpp_extension``, ninja) does the
rest.  The build takes tens of seconds once per host, torch version and source; ``scripts/setup.sh`` runs it
(``python3 -m kernels.cpu_ext``) so that no engine start pays for it.

``PAGEKEEPER_CPU_KERNELS`` chooses:
- ``auto`` (the default): build or load it; if that fails (no compiler, say), warn once with the reason and use
  the torch path, which gives the same results more slowly;
- ``off``: always the torch path (A/B runs, or a host where building is not wanted);
- ``require``: fail with the reason instead of falling back (CI and benchmarks that must measure the kernel).

The cache lives in ``$PAGEKEEPER_CACHE_DIR``, else ``$CACHE_DIRECTORY`` (systemd's ``CacheDirectory=``), else
``$XDG_CACHE_HOME/pagekeeper``, else ``~/.cache/pagekeeper``; its folder name hashes the source, torch's version,
the compiler flags and the host's CPU flags, so a change of any of them builds anew instead of loading a stale
or foreign build.  A folder whose build completed holds a `built` marker, and an engine start loads the library
from it directly; only a build goes through torch's machinery, under a lock that dies with its holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch

from engine.cache_dir import cache_root

log = structlog.get_logger("pagekeeper.kernels")

ENV = "PAGEKEEPER_CPU_KERNELS"
MODES = ("auto", "off", "require")
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name for name in ("cpu_paged_decode.cpp", "cpu_fused.cpp", "cpu_linear.cpp")
)
HEADERS = (Path(__file__).parent / "csrc" / "cpu_exp.h",)  # in the build key too: a change must rebuild
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17")


class CpuKernelsUnavailable(RuntimeError):
    """The extension could not be built or loaded, and PAGEKEEPER_CPU_KERNELS=require."""


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of `choices` (the first when unset or empty); a value we do not know is an
    error, never silently the default."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def mode() -> str:
    """PAGEKEEPER_CPU_KERNELS, checked."""
    return env_choice(ENV, MODES)


def _cpu_flags() -> str:
    """The host's CPU feature flags: a build made with -march=native is only valid where these match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    digest = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        digest.update(src.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(CFLAGS), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch's build runs `ninja` from PATH.  The `ninja` package this project depends on goes first, whatever
    PATH holds: a venv's python started by its full path (as a systemd unit does) does not have it on PATH, and
    another ninja found there (a distribution's 1.11 beside the package's 1.13) writes a build log the other cannot
    read, so each rebuilt the cached extension the other had built: 10-40 s at every start that alternated between
    `opsctl start` from a shell and systemd (seen in the systemd tests)."""
    try:
        import ninja
    except ImportError:
        return  # the build then uses a ninja on PATH, or says that ninja is missing
    if not os.path.exists(os.path.join(ninja.BIN_DIR, "ninja")):
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:  # the environment's own scripts directory, as a venv's activate
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])


BUILT_MARKER = "built"  # written once a build in the folder completed and loaded; its text says when and by whom
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton: a file that only the process holding it removes


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder per folder, with a lock the kernel drops when its holder dies.

    torch's own lock is a file its holder deletes when done: an engine killed inside `cpp_extension.load` (kill -9
    during start-up, a restart of a hung start, the OOM killer) left it behind, and every later engine on the host
    waited on it forever in start-up (opsctl start timed out at 90 s in three tests in a row).  Under
    this flock no other live engine is inside `load` for this folder, so a `lock` file there is one a dead process
    left, and is removed.
    """
    with open(directory / "build.flock", "a") as held:  # closing it releases the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = directory / TORCH_LOCK
        if stale.exists():
            log.warning("cpu_kernels_stale_lock_removed", path=str(stale))
            stale.unlink(missing_ok=True)
        yield


def _build_and_load() -> None:
    key = build_key()
    directory = cache_root() / "cpu-ext" / key
    name = f"pagekeeper_cpu_{key}"
    library = directory / f"{name}.so"
    if _load_finished(directory, library):
        return
    from torch.utils import cpp_extension

    _ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        if _load_finished(directory, library):  # another engine finished the build while this one waited
            return
        # unfinished (its builder died, perhaps inside the link) or damaged: link it anew, which ninja, seeing
        # a library newer than its object file, would not do; compiling again is ninja's own choice
        (directory / BUILT_MARKER).unlink(missing_ok=True)
        library.unlink(missing_ok=True)
        started = time.monotonic()
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        marker = directory / f".{BUILT_MARKER}.{os.getpid()}"
        marker.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()}\n")
        os.replace(marker, directory / BUILT_MARKER)
    log.info("cpu_kernels_built", directory=str(directory), seconds=round(time.monotonic() - started, 2))


def _load_finished(directory: Path, library: Path) -> bool:
    """Load a build that completed, taking no lock and running no ninja (a read-only cache, as a container image
    may ship, works too); False when there is none or it no longer loads (deleted or damaged since)."""
    if not (directory / BUILT_MARKER).exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        log.warning("cpu_kernels_reload_failed", directory=str(directory), error=(str(e).splitlines() or [""])[0])
        return False
    log.debug("cpu_kernels_loaded", directory=str(directory))
    return True


@functools.cache
def unavailable_reason() -> str | None:
    """None once the extension is loaded in this process; otherwise why not (the torch path is used)."""
    chosen = mode()
    if chosen == "off":
        return f"{ENV}=off"
    try:
        _build_and_load()
    except Exception as e:  # a missing compiler, an unwritable cache, a failed build: all mean the same here
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        reason = f"the CPU extension could not be built or loaded ({type(e).__name__}: {first_line})"
        if chosen == "require":
            raise CpuKernelsUnavailable(f"{reason}; {ENV}=require") from e
        log.warning("cpu_kernels_unavailable", reason=reason, fallback="torch operations (slower decode)")
        return reason
    return None


def available() -> bool:
    return unavailable_reason() is None


def paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Decode attention of one query token per sequence over its blocks, read in place; writes `out`.
    Shapes: query/out ``[B, Hq, D]``, cache halves ``[num_blocks, block_size, Hkv, D]``, block_tables ``[B, W]``
    and seq_lens ``[B]`` int32.  Call only when `available()`."""
    torch.ops.pagekeeper_cpu.paged_decode(out, query, k_cache, v_cache, block_tables, seq_lens, scale)


if __name__ == "__main__":
    # scripts/setup.sh: build now, so that no engine start pays for it; exit 1 with the reason if it fails
    os.environ.setdefault(ENV, "require")
    t = time.monotonic()
    unavailable_reason()
    print(f"CPU extension ready in {cache_root() / 'cpu-ext' / build_key()} ({time.monotonic() - t:.1f} s)")
