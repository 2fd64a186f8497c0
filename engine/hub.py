"""`--model org/name`: a Hugging Face Hub id, resolved to a checkpoint directory in the Hugging Face cache.

vLLM, SGLang and TGI all take a Hub id and use the Hugging Face cache; a newcomer tries that first.  Resolution goes
through `huggingface_hub` (the library the Hub's own client is, kept by Hugging Face): a download when the Hub is
reachable, else the snapshot already in the local cache (`HF_HUB_OFFLINE=1` skips the attempt to reach it), and one
line naming both when neither works.  Only what the engine reads is fetched: configs, safetensors, tokenizer files.
A value that names an existing directory is always that directory, never a Hub id.
"""

from __future__ import annotations

import functools
import os
import re

from engine.config import ConfigError

# owner/name (or a bare name), as the Hub spells repository ids
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def is_hub_id(model: str) -> bool:
    """Not an existing path, and shaped like a Hub repository id."""
    return not os.path.exists(os.path.expanduser(model)) and bool(_HUB_ID.match(model)) and ".." not in model


@functools.lru_cache(maxsize=16)
def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The snapshot directory of `repo_id` in the Hugging Face cache, downloaded first when the Hub is reachable."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        raise ConfigError(
            f"--model {repo_id}: not a local directory, and huggingface_hub (which resolves Hub ids) is not installed; "
            "give a checkpoint directory or pip install huggingface_hub"
        ) from None
    try:
        return str(snapshot_download(repo_id, revision=revision, allow_patterns=FILES))
    except Exception as e:  # no network, no such repository, gated: the cache may still have it
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            online = "not asked: HF_HUB_OFFLINE is set"
        else:
            online = (" ".join(str(e).split()) or type(e).__name__)[:100]
    try:
        return str(snapshot_download(repo_id, revision=revision, allow_patterns=FILES, local_files_only=True))
    except Exception:
        pass
    raise ConfigError(
        f"--model {repo_id}: not a local directory, not in the Hugging Face cache ({HF_HUB_CACHE}), and the Hub did "
        f"not provide it ({online}); run `huggingface-cli download {repo_id}` where the Hub is reachable, or give a "
        "checkpoint directory"
    )
