"""Loading a checkpoint's tokenizer, without torch: the engine core and the front (engine/loop/) both load one.

The `tokenizers` library builds it where engine/model/hf_tokenizer.py can do so as transformers would; transformers'
AutoTokenizer (imported only then) otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from engine.config import ConfigError, EngineConfig
from engine.model.checkpoint_dir import require_tokenizer_dir
from engine.model.hf_tokenizer import read_tokenizer

log = structlog.get_logger("pagekeeper.loader")


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer on the `tokenizers` library where engine/model/hf_tokenizer.py can build it as transformers
    would, else transformers' AutoTokenizer (imported only then).  Transformers' own length limit is lifted: the
    engine checks every prompt against max_model_len itself (a 400 naming the field), and its "Token indices
    sequence length is longer than the specified maximum" warning for a prompt it is about to refuse only added a
    plain line to the log."""
    source = config.tokenizer or config.model_path()
    require_tokenizer_dir(source)
    directory = Path(source).expanduser()
    if config.trust_remote_code:
        why = "--trust-remote-code: the checkpoint's own code may build it"
    else:
        tokenizer, why = read_tokenizer(directory)
        if tokenizer is not None:
            return tokenizer
    log.debug("tokenizer_loaded_by_transformers", tokenizer=str(directory), reason=why)
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    from engine.logs import route_library_logger

    route_library_logger("transformers")  # its warnings as our JSON lines, where we log JSON
    try:
        auto = AutoTokenizer.from_pretrained(
            str(directory), trust_remote_code=config.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer at {source} could not be loaded: {e}; pass --tokenizer DIR") from e
    auto.model_max_length = VERY_LARGE_INTEGER
    return auto
