"""An engine's side of the keeper: ask for this rank's weights and build the model around them.

`kept_model` returns None, with one logged reason, whenever the kept weights cannot be used (no keeper
configured, its socket gone, it failed or holds other weights, it is still loading after the wait); the caller
then loads the checkpoint itself.  That is the whole of the degradation: a dead keeper costs a normal cold start,
never an outage.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from engine.config import EngineConfig, ResolvedConfig
from engine.keeper.arena import TensorView, open_shared, replace_tensors, unique_tensors, view_of
from engine.keeper.protocol import request, weights_key
from engine.model.interface import CausalLM
from engine.model.loader import ModelInfo, build_on_meta
from engine.model.weights import finish_loading
from engine.parallel.group import SINGLE, TPGroup

log = structlog.get_logger("pagekeeper.engine")

# How long an engine waits for a keeper that is still loading (it started beside the engine: the same load the
# engine would do itself, already under way).
KEEPER_WAIT_S = 900.0
_POLL_S = 0.1
_REQUEST_TIMEOUT_S = 30.0


class KeptWeightsMismatch(RuntimeError):
    """The kept tensors do not fit the model this engine builds (names, shapes or dtypes differ)."""


@dataclass
class KeptModel:
    model: CausalLM
    device_bytes: int  # what the kept weights occupy on this rank's device (counted as weights, once)
    keeper_pid: int
    seconds: float


def kept_model(
    config: EngineConfig | ResolvedConfig,
    info: ModelInfo,
    max_model_len: int,
    device: torch.device,
    tp: TPGroup = SINGLE,
    wait_s: float = KEEPER_WAIT_S,
) -> KeptModel | None:
    """The model built around the keeper's weights for this rank, or None (the reason is logged)."""
    if not config.weights_keeper:
        return None
    started = time.monotonic()
    path = Path(config.weights_keeper)
    key = weights_key(config, str(info.dtype).removeprefix("torch."), _quant_name(info))
    deadline = started + wait_s
    while True:
        try:
            reply, payload, fds = request(path, "weights", _REQUEST_TIMEOUT_S, key=key, rank=tp.rank)
        except (OSError, ValueError) as e:
            return _unavailable(path, f"the keeper does not answer ({e})")
        if reply.get("ok"):
            break
        if reply.get("state") != "loading":
            return _unavailable(path, str(reply.get("error") or f"the keeper is {reply.get('state')}"))
        if time.monotonic() >= deadline:
            return _unavailable(path, f"the keeper was still loading after {wait_s:.0f} s")
        time.sleep(_POLL_S)
    views, handles = pickle.loads(payload)
    try:
        storages = open_shared(handles, fds)
        model = build_on_meta(info, max_model_len, device, tp)
        attach(model, views, storages, device)
    except (KeptWeightsMismatch, RuntimeError, ValueError) as e:
        return _unavailable(path, f"the kept weights could not be used: {e}")
    finish_loading(model)
    seconds = round(time.monotonic() - started, 3)
    device_bytes = int(reply.get("device_bytes") or 0)
    log.info(
        "engine_weights_from",
        source="keeper",
        keeper_pid=reply.get("pid"),
        rank=tp.rank,
        bytes=device_bytes,
        seconds=seconds,
    )
    return KeptModel(model.eval(), device_bytes, int(reply.get("pid") or 0), seconds)


def attach(model: CausalLM, views: list[TensorView], storages: list[torch.Tensor], device: torch.device) -> None:
    """Replace every meta tensor of `model` with the kept one of the same name: parameters shared, buffers copied
    (an engine changes its buffers, e.g. the FP8 KV cache's calibrated scales)."""
    by_name = {v.name: v for v in views}
    new_by_id = {}
    for name, is_param, t in unique_tensors(model):
        v = by_name.pop(name, None)
        if v is None:
            raise KeptWeightsMismatch(f"the keeper has no {name}")
        if v.shape != tuple(t.shape) or v.dtype != t.dtype or v.is_param != is_param:
            raise KeptWeightsMismatch(
                f"{name}: kept {v.dtype} {list(v.shape)}, this engine builds {t.dtype} {list(t.shape)}"
            )
        kept = view_of(storages[v.storage], v)
        if not _same_device(kept.device, device):
            raise KeptWeightsMismatch(f"{name} is kept on {kept.device}, this rank runs on {device}")
        new_by_id[id(t)] = kept if is_param else kept.clone()
    if by_name:
        raise KeptWeightsMismatch(f"the keeper has tensors this model lacks, e.g. {sorted(by_name)[:3]}")
    replace_tensors(model, new_by_id)


def _same_device(a: torch.device, b: torch.device) -> bool:
    def index(d: torch.device) -> int | None:
        return d.index if d.index is not None or d.type != "cuda" else torch.cuda.current_device()

    return a.type == b.type and index(a) == index(b)


def _quant_name(info: ModelInfo) -> str | None:
    return info.quant.describe() if info.quant is not None else None


def _unavailable(path: Path, reason: str) -> KeptModel | None:
    """None, logged with its reason: the engine loads the checkpoint itself."""
    log.warning("engine_weights_from", source="checkpoint", keeper=str(path), reason=reason)
    return None
