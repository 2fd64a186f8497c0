"""The checks on a --model directory that need neither torch nor transformers.

The server runs them while it parses its flags, before it imports torch: a mistyped path is the commonest
start-up mistake, and on a loaded 2-core host the imports alone took 12 s before the engine could say so
(an `opsctl start` with a bad path waited for them).  The loader runs them again for the offline API.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import ConfigError


def require_checkpoint_dir(path: Path) -> None:
    """Refuse a path that is not a local HF checkpoint directory, naming what is missing."""
    if not path.is_dir():
        raise ConfigError(
            f"--model {path}: no such directory; pagekeeper loads local HF checkpoint directories "
            "(config.json + *.safetensors + tokenizer files)"
        )
    if not (path / "config.json").exists():
        raise ConfigError(f"--model {path}: no config.json in the directory, so it is not an HF checkpoint")


def require_tokenizer_dir(source: str) -> None:
    """A hub name would mean a download: refused at once instead of minutes of network retries."""
    if not Path(source).expanduser().is_dir():
        raise ConfigError(
            f"--tokenizer {source}: no such directory; pagekeeper loads tokenizers from local "
            "directories only (download it first, then pass its path)"
        )
