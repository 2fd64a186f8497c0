"""Start-up measurements kept on disk, keyed by everything their answer depends on.

Some of what start-up measures depends only on the GPU, the model's shapes, the settings that size a step and
the versions of the code: the peak memory of the largest step (the KV budget's activation figure), the memory the
CUDA graphs' pool keeps, and which token counts get piecewise graphs.  Measured once, they are read back on
every later start of the same deployment (a restart, a crash, a second replica on the same host), which saves
seconds of profiling and capture each time.  Memory that other processes hold is never cached: it is read live.

The key covers the GPU (name, compute capability, total memory), torch, triton and CUDA versions, this
package's code (its source files' sizes and modification times), the model's config.json values, dtype,
quantization and KV dtype, the tensor-parallel rank and size, and every engine setting that changes a step's
shape.  A miss says why in one log line (`probe_cache_miss`); a file that does not parse is a miss.  The
directory is `probes` under the cache folder (engine/cache_dir.py: default `~/.cache/pagekeeper/probes`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.cache_dir import cache_root
from engine.config import EngineConfig, ResolvedConfig
from engine.logs import startup_detail

log = structlog.get_logger("pagekeeper.engine")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return cache_root() / "probes"


def _code_fingerprint() -> list[Any]:
    """Sizes and modification times of the engine's and kernels' sources: a change to either is a new key."""
    out = []
    for package in ("engine", "kernels"):
        for path in sorted((_PACKAGE_ROOT / package).rglob("*.py")):
            st = path.stat()
            out.append((str(path.relative_to(_PACKAGE_ROOT)), st.st_size, st.st_mtime_ns))
    return out


def _versions(device: torch.device) -> dict[str, Any]:
    """torch's, and on a GPU CUDA's and Triton's: only the CUDA kernels depend on Triton, and importing it just
    for this key took 0.15 s of every CPU engine's start (the CUDA kernels import it anyway)."""
    if device.type != "cuda":
        return {"torch": torch.__version__}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}


def _gpu(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": device.type}
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": [props.major, props.minor], "total_memory": props.total_memory}


class ProbeCache:
    """Get and put named measurements for one engine start (one rank)."""

    def __init__(
        self,
        config: EngineConfig | ResolvedConfig,
        model_config: dict[str, Any],
        dtype: str,
        kv_dtype: str,
        device: torch.device,
        rank: int = 0,
        directory: Path | None = None,
    ) -> None:
        settings = {
            name: getattr(config, name)
            for name in (
                "max_model_len",
                "max_num_batched_tokens",
                "max_num_seqs",
                "block_size",
                "enforce_eager",
                "enable_chunked_prefill",
                "quantization",
                "kv_cache_dtype",
                "tensor_parallel_size",
                "load_format",
            )
        }
        self.parts = {
            "gpu": _gpu(device),
            "versions": _versions(device),
            "code": _code_fingerprint(),
            "model": {k: v for k, v in model_config.items() if not k.startswith("_")},
            "dtype": dtype,
            "kv_dtype": kv_dtype,
            "rank": rank,
            "settings": settings,
        }
        digest = hashlib.sha256(json.dumps(self.parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
        self.key = digest
        self.path = (directory or cache_dir()) / f"{digest}.json"
        self._values: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._values is None:
            try:
                self._values = dict(json.loads(self.path.read_text()).get("values", {}))
            except (OSError, ValueError, AttributeError):
                self._values = {}
        return self._values

    def get(self, name: str) -> Any:
        """The cached value, or None (logged as a miss)."""
        value = self._load().get(name)
        if value is None:
            reason = "no file for this key" if not self.path.exists() else "not measured under this key yet"
            startup_detail(log, "probe_cache_miss", probe=name, key=self.key, reason=reason)
        return value

    def put(self, name: str, value: Any) -> None:
        """Store a measurement; an unwritable cache only costs the next start its measurement."""
        values = self._load()
        values[name] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.parts, "values": values}, default=str))
            tmp.replace(self.path)
        except OSError as e:
            log.warning("probe_cache_unwritable", path=str(self.path), error=str(e))
